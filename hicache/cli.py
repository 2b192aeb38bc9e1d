"""`hicache` command line: serve | health | stats | config check | bench ..."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import stat
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

import yaml

from hicache.argtypes import UsageError, address
from hicache.config import (
    HicacheConfig,
    header_value,
    load_config,
    one_line,
    read_named_file,
    redact_url,
    to_plain,
)
from hicache.endpoint import parse_address
from hicache.errors import ConfigError, FailedPrecondition, HicacheError
from hicache.signals import watch_hangups, watch_stack_dumps

log = logging.getLogger("hicache")

# `hicache bench NAME` runs hicache.bench.NAME, a module with add_arguments(parser) and
# run(args) -> int. Imported only when chosen, so a benchmark's heavy imports stay out of
# the other commands.
BENCHMARKS = {
    "tree": "radix tree: match / insert / evict cost on a multi-turn workload",
    "tiers": "L1<->L2 copies and L3 backends vs their raw baselines",
    "controller": "L3->L1 prefix vs raw read+copy; serving latency with a dead L3",
    "gpu": "CUDA IPC export/import and pinned L1<->L2 copies vs plain torch copies",
    "rpc": "gRPC control plane: empty call vs a request round, plain and batched",
    "multiturn": "multi-turn serving against a real daemon: hit rate per round vs the ceiling",
}


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def describe(cfg: HicacheConfig) -> str:
    """The resolved configuration with derived sizes in human units."""
    plain = to_plain(cfg)
    for entry in plain["server"]["tokens"]:  # (what config check prints may end up in logs)
        entry["token"] = "(hidden)"
    # (URLs that may hold a password)
    plain["storage"]["redis"]["url"] = redact_url(cfg.storage.redis.url)
    if cfg.storage.mooncake.metadata_server is not None:
        plain["storage"]["mooncake"]["metadata_server"] = redact_url(cfg.storage.mooncake.metadata_server)
    lines = [yaml.safe_dump(plain, sort_keys=False).rstrip(), "", "# derived"]
    l1 = cfg.l1_pages
    l2 = cfg.l2_pages(l1)
    lines.append(f"page_size: {cfg.model.page_size} tokens")
    lines.append(f"l1_pages: {l1} ({l1 * cfg.model.page_size} tokens)")
    lines.append(f"l2_pages: {l2} ({l2 * cfg.model.page_size} tokens)")
    lines.append(f"host_layout: {cfg.host_layout.value}")
    # What seeds every L3 key: daemons sharing an L3 must print the same line to share pages.
    lines.append(f"l3_key_seed: model={cfg.model.id} kv_dtype={cfg.model.kv_dtype} "
                 f"geometry={cfg.model.geometry}")
    from hicache.tiers.sizing import host_pages, slot_bytes  # (no torch: config check stays quick)

    l2_of = host_pages(cfg)
    l1_bytes = l2_bytes = 0
    for m in cfg.model.members:
        pages = cfg.pages_for(m.component)
        member_l1 = pages * m.bytes_per_page
        member_l2 = l2_of[m.component] * slot_bytes(m, cfg.host_layout)
        l1_bytes += member_l1
        l2_bytes += member_l2
        lines.append(
            f"member {m.name}: component={m.component.value} layers={m.layers} "
            f"page={_human_bytes(m.bytes_per_page_per_layer)}/layer "
            f"l1={pages} x {_human_bytes(m.bytes_per_page)} = {_human_bytes(member_l1)} "
            f"l2={l2_of[m.component]} x {_human_bytes(slot_bytes(m, cfg.host_layout))} = "
            f"{_human_bytes(member_l2)}"
        )
    lines.append(f"l1_bytes: {_human_bytes(l1_bytes)}")
    lines.append(f"l2_bytes: {_human_bytes(l2_bytes)}")
    return "\n".join(lines)




def _out(text: str) -> None:
    """A command's report on stdout. A reader that went away (`hicache health | head -1`)
    is no error of the command: the rest goes nowhere and its exit code stands."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    """After a broken pipe: stdout stays open on /dev/null, so the interpreter's flush at
    exit finds no pipe (and raises nothing)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _cmd_config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file, args.set)
    _out(describe(cfg))
    # Valid (exit 0): the file may be meant for another host. On this one, `serve` would
    # refuse an L2 that does not fit: said here, as a warning.
    from hicache.tiers.sizing import check_host_fit

    try:
        check_host_fit(cfg)
    except (ConfigError, FailedPrecondition) as e:
        print(f"hicache: warning: on this host, serve would refuse it: {e}", file=sys.stderr)
    return 0


def _serve_overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.set)
    if args.listen is not None:  # ('' too: an unset variable must not mean the default)
        # As a quoted YAML string: an address is taken literally ('[::1]:50051' is a
        # YAML list, ' #' starts a comment).
        overrides.append(f"server.listen={json.dumps(args.listen)}")
    return overrides


def _cmd_serve(args: argparse.Namespace) -> int:
    # First (before the server's imports and any file read): a SIGHUP during the start is
    # a reload once ready, a SIGUSR1 a stack dump (see hicache.signals).
    hangups = watch_hangups()
    watch_stack_dumps()
    from hicache.server import serve

    overrides = _serve_overrides(args)
    cfg = load_config(args.config, overrides)
    _warn_readable_secrets(args.config, cfg)
    from hicache import allocator

    def load() -> HicacheConfig:  # (SIGHUP: the same file and overrides, read again)
        reloaded = load_config(args.config, overrides)
        _warn_readable_secrets(args.config, reloaded)
        return reloaded

    # The daemon's process: large page-id arrays from the heap (see hicache.allocator).
    allocator.tune()
    return serve(cfg, load=load, hangups=hangups)


def _warn_readable_secrets(config_path: str | None, cfg: HicacheConfig) -> None:
    """Say so (as sshd does of a loose key) when the file holding the tokens, or the TLS
    key, is readable by every local user: anyone could then use any tenant's token."""
    secrets = [(cfg.server.tls_key, "is server.tls_key"),
               (cfg.server.tokens_file, "is server.tokens_file")]
    if cfg.server.tokens and config_path and _file_sets_tokens(config_path):
        secrets.append((config_path, "holds server.tokens"))
    for path, what in secrets:
        try:
            mode = os.stat(path).st_mode if path else 0
        except OSError:
            continue  # (the start names a TLS key it cannot read)
        if mode & stat.S_IROTH:
            log.warning("%s %s and is readable by every local user (mode %o): `chmod o-r` it",
                        path, what, stat.S_IMODE(mode))


def _file_sets_tokens(path: str) -> bool:
    """Whether the YAML file at `path` (the config just loaded from it) sets server.tokens
    (they may come from `--set` instead)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    server = doc.get("server") if isinstance(doc, dict) else None
    return isinstance(server, dict) and bool(server.get("tokens"))


def _cmd_health(args: argparse.Namespace) -> int:
    from hicache.ops import health_report

    report, rc = health_report(_target(args), args.deep, _token(args), _ca(args))
    _out(json.dumps(report, indent=2) if args.json else _render_health(report))
    return rc


def _render_health(report: dict[str, Any]) -> str:
    target = one_line(report["target"])  # (a control character in a path would split it)
    if "error" in report:
        state = "ANSWERS" if report["reachable"] else "UNREACHABLE"
        return f"daemon at {target}: {state} ({one_line(report['error'])})"
    lines = [f"daemon at {target}: {'SERVING' if report['serving'] else 'NOT_SERVING'}"]
    for b in report["backends"]:
        state = "healthy" if b["healthy"] else "UNHEALTHY"
        latency = "? ms" if b["latency_ms"] is None else f"{b['latency_ms']:.1f} ms"
        lines.append(f"  {b['name']}: {state} {latency} {b['detail']}".rstrip())
    if "note" in report:
        lines.append(f"  ({report['note']})")
    elif not report["backends"]:
        lines.append("  (no L3 backend configured)")
    return "\n".join(lines)


def _cmd_stats(args: argparse.Namespace) -> int:
    from hicache.ops import stats_report

    report, rc = stats_report(_target(args), _token(args), _ca(args))
    if args.json or rc:
        _out(json.dumps(report, indent=2))
        return rc
    lines = [f"{'tier':8} {'member':12} {'capacity':>10} {'used':>10} {'locked':>10}"]
    for p in report["pools"]:
        lines.append(
            f"{p['tier']:8} {p['member']:12} {p['capacity_pages']:>10} {p['used_pages']:>10} "
            f"{p['locked_pages']:>10}"
        )
    lines.append("")
    lines.extend(f"{k}: {v}" for k, v in sorted(report["counters"].items()))
    _out("\n".join(lines))
    return 0


def _target(args: argparse.Namespace) -> str:
    """--target, else the config's `server.listen`; a wildcard bind (0.0.0.0, [::]) is
    dialled on the matching loopback address (a TLS certificate must then name it)."""
    if args.target:
        return str(args.target)
    listen = parse_address(load_config(args.config).server.listen)
    loopback = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(listen.host)
    return f"{loopback}:{listen.port}" if loopback else listen.address


def _ca(args: argparse.Namespace) -> bytes | None:
    """Root certificates for a TLS daemon: --ca-file, else (the target taken from a
    config that serves TLS) that config's own certificate, which a self-signed daemon
    needs; None leaves the system's roots (or plaintext where TLS is not used)."""
    path = args.ca_file
    if path is not None and parse_address(_target(args)).is_unix:
        raise UsageError("--ca-file is for a TLS daemon on a TCP address; a unix socket is never TLS")
    if path is None and args.target is None:
        server = load_config(args.config).server
        if not parse_address(server.listen).is_unix:  # TLS is for TCP only
            path = server.tls_cert
    if path is None:
        return None
    return _read(path, "--ca-file" if args.ca_file is not None else "server.tls_cert")


def _token(args: argparse.Namespace) -> str | None:
    if not args.token_file:
        return None
    data = _read(args.token_file, "--token-file")
    token = data.decode(errors="replace").strip()  # (empty: no token, as without the option)
    if not header_value(token):  # (never printed)
        raise UsageError(f"--token-file {one_line(args.token_file)}: the token must be one "
                         "line of printable ASCII (a bearer token)")
    return token or None


def _read(path: str, what: str) -> bytes:
    return read_named_file(path, what, UsageError)  # (exit 2)


def _cmd_bench(args: argparse.Namespace) -> int:
    from hicache.bench.services import ServiceError

    module = importlib.import_module(f"hicache.bench.{args.bench_name}")
    try:
        rc: int = module.run(args)
    except ServiceError as e:  # a service binary (or CUDA) this benchmark needs is missing
        print(f"hicache bench {args.bench_name}: cannot run here: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a daemon or engine process the benchmark started failed
        print(f"hicache bench {args.bench_name}: {e}", file=sys.stderr)
        return 1
    return rc


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The whole command line. `benchmarks=False` leaves the benchmarks' own options out:
    they import their modules (torch among them, seconds of start-up), which `hicache
    health` run as a Kubernetes exec probe must not pay."""
    p = argparse.ArgumentParser(prog="hicache", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="hicache.yaml (default: the embedded one)")
    s.add_argument("--listen", help="unix:///path or host:port (overrides server.listen)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key by its dotted path, e.g. storage.backend=redis")
    s.set_defaults(func=_cmd_serve)

    for name, help_text, func in (
        ("health", "probe the daemon and its L3 backends (exit 0 ok, 1 unhealthy, 2 unreachable)",
         _cmd_health),
        ("stats", "pool usage and counters", _cmd_stats),
    ):
        h = sub.add_parser(name, help=help_text)
        h.add_argument("--target", type=address,
                       help="unix:///path or host:port (default: server.listen)")
        h.add_argument("--config", help="hicache.yaml whose server.listen is the default target")
        h.add_argument("--token-file", help="file holding a bearer token (TCP with tokens)")
        h.add_argument("--ca-file", help="PEM root certificates of a TLS daemon (default: with "
                       "--config, its server.tls_cert; else the system's)")
        h.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "health":
            h.add_argument("--deep", action="store_true",
                           help="canary write/read/verify/delete on each backend now")
        h.set_defaults(func=func)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    cc = csub.add_parser("check", help="validate a file and print the resolved configuration")
    cc.add_argument("file", nargs="?", help="hicache.yaml (default: the embedded one)")
    cc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    cc.set_defaults(func=_cmd_config_check)

    b = sub.add_parser("bench", help="benchmarks (ratios measured in one run)")
    if not benchmarks:
        return p
    bsub = b.add_subparsers(dest="bench_name", required=True)
    for name, help_text in BENCHMARKS.items():
        bp = bsub.add_parser(name, help=help_text)
        try:
            module = importlib.import_module(f"hicache.bench.{name}")
        except ImportError as e:  # a benchmark whose optional dependency is missing
            bp.set_defaults(func=lambda _a, e=e: _missing(e))
            continue
        module.add_arguments(bp)
        bp.set_defaults(func=_cmd_bench)
    return p


def _missing(e: ImportError) -> int:
    print(f"hicache: this benchmark cannot run here: {e}", file=sys.stderr)
    return 2


def process_defaults(environ: MutableMapping[str, str]) -> None:
    """Environment defaults of a hicache process, set before torch is imported (an
    operator's own setting wins).

    OMP_WAIT_POLICY=PASSIVE: the copy engine runs torch ops on OpenMP threads and numpy
    copies on threads of its own. With OpenMP's default active wait, torch's threads spin
    for milliseconds after each parallel region and take the cores the next copy needs:
    on 2 cores an L2->L1 copy measured 0.74-0.78x of a contiguous copy with active wait,
    0.82-0.93x with passive wait (`hicache bench tiers --skip-l3`)."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand: the first argument that is not an option (the top level has only
    flags, no option takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    process_defaults(os.environ)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(benchmarks=_command_of(argv) in ("bench", None)).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        rc: int = args.func(args)
        return rc
    except ConfigError as e:
        print(f"hicache: configuration error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:  # options that contradict each other (argparse cannot tell)
        print(f"hicache: {e}", file=sys.stderr)
        return 2
    except HicacheError as e:
        print(f"hicache: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        # A file named on the command line or in the config (certificate, token).
        print(f"hicache: {one_line(str(e.filename))}: {e.strerror}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # a benchmark's reader went away: its figures are lost
        _stdout_to_devnull()
        print("hicache: stdout was closed before the output was written", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
