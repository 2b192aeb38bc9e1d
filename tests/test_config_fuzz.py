"""Property-based fuzzing of the configuration loader.

Every key of the embedded `hicache.yaml` (found by walking it, so a new key is covered
without touching this file), plus the keys that only a richer configuration has (SWA,
MAMBA, sidecars, tokens, TLS, Mooncake...), is mutated one at a time to a value of a
random type, an unknown key is added at every level, and the same is driven through
`--set KEY=VALUE` and through YAML text. The invariant: the loader either returns a
valid frozen configuration (whose derived sizes and `config check` output can be
computed), or raises `ConfigError` naming the dotted key that was wrong, on one line,
never a bare Python exception and never a `server.tokens` value.

The bugs this fuzzing found are pinned by the plain tests at the end. Environment knobs
for a bug hunt:

    HICACHE_FUZZ_EXAMPLES=5000   examples per property test (default 150)
    HICACHE_FUZZ_RANDOM=1        derandomize=False (a new seed each run)
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from hicache.cli import describe
from hicache.config import (
    HicacheConfig,
    apply_override,
    build_config,
    default_config_text,
    load_config,
    parse_yaml,
    to_plain,
)
from hicache.errors import ConfigError

FUZZ = fuzz_settings(150)

SECRET = "fuzz-SECRET-token-0123456789abcdef"  # a valid token (>= 16 printable ASCII)
HICACHE = str(Path(sys.executable).with_name("hicache"))

# --------------------------------------------------------------------------- bases

DEFAULT_RAW: dict[str, Any] = parse_yaml(default_config_text())


def _rich() -> dict[str, Any]:
    """The default plus every optional part: SWA, MAMBA, sidecars, a token (the secret)."""
    raw = copy.deepcopy(DEFAULT_RAW)
    raw["model"]["components"]["swa"] = {"layers": 2, "bytes_per_token_per_layer": 128, "window_tokens": 1024}
    raw["model"]["components"]["mamba"] = {"layers": 2, "state_bytes_per_layer": 16384}
    raw["model"]["sidecars"] = {
        "indexer": {"anchor": "full", "layers": 4, "bytes_per_token_per_layer": 16},
        "conv": {"anchor": "mamba", "layers": 2, "state_bytes_per_layer": 64},
    }
    raw["server"]["tokens"] = [{"token": SECRET, "namespaces": ["ns-a", "*"]}]
    raw["storage"]["backend"] = "file"
    return raw


def _wired() -> dict[str, Any]:
    """Every optional (null by default) key given a value, sizes in GiB, Mooncake."""
    raw = _rich()
    raw["tiers"]["l1"]["size_gb"] = 0.5
    raw["tiers"]["l2"]["size_gb"] = 2.0
    raw["tiers"]["l2"]["layout"] = "page_first"
    raw["storage"]["backend"] = "mooncake"
    raw["storage"]["file"].update(capacity_gb=10.0, threads=4)
    raw["storage"]["mooncake"].update(master="10.0.0.1:50051", metadata_server="http://10.0.0.1:8080/metadata",
                                      protocol="rdma", device="mlx5_0", global_segment_size=1 << 30)
    raw["storage"]["redis"]["ttl_s"] = 3600
    raw["server"].update(listen="127.0.0.1:50051", probe_listen="0.0.0.0:50052",
                         tls_cert="/etc/hicache/cert.pem", tls_key="/etc/hicache/key.pem")
    return raw


BASES: dict[str, dict[str, Any]] = {"default": DEFAULT_RAW, "rich": _rich(), "wired": _wired()}
# The plain form of each (`to_plain`) lists every field of the schema, defaults included:
# keys the YAML leaves out (a component's window_tokens, ...) are mutated there.
BASES.update({f"{name}/plain": to_plain(build_config(raw)) for name, raw in list(BASES.items())})

Path_ = tuple[Any, ...]  # keys (str, or whatever YAML allows) and list indices (int)


def walk(node: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every node below the root: sections, leaves, list items."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*path, k), v
            yield from walk(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield (*path, i), v
            yield from walk(v, (*path, i))


def sections(node: Any, path: Path_ = ()) -> Iterator[Path_]:
    """Every mapping, the root included."""
    if isinstance(node, dict):
        yield path
        for k, v in node.items():
            yield from sections(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from sections(v, (*path, i))


PATHS = {name: [p for p, _ in walk(raw)] for name, raw in BASES.items()}
SECTIONS = {name: list(sections(raw)) for name, raw in BASES.items()}
# --set takes dotted keys: no list items.
DOTTED = sorted({".".join(p) for raws in PATHS.values() for p in raws if all(isinstance(k, str) for k in p)})


def dotted(path: Path_) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) and not isinstance(k, bool) else (f".{k}" if out else str(k))
    return out


def get_at(raw: Any, path: Path_) -> Any:
    for k in path:
        raw = raw[k]
    return raw


def set_at(raw: dict[str, Any], path: Path_, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    get_at(out, path[:-1])[path[-1]] = value
    return out


# --------------------------------------------------------------------------- values

SPECIAL_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, 2**70, 10**308, 2**1024, 10**400, -(2**70), -(10**400)]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-300, 0.5, 1.0000001, 1.0000000001,
                  math.nextafter(1.0, 2.0), 2.5,
                  1e300, 1e306, 1e308, 1.7976931348623157e308]
SPECIAL_TEXT = [
    "", " ", "abc", "64", " 64", "0660", "0o777", "0x1f", "1e3", "true", "null", "~", "nan",
    "full", "swa", "mamba", "lru", "write_back", "page_first", "layer_first", "mooncake", "redis", "file", "none",
    "unix:///tmp/fuzz.sock", "unix://rel.sock", "unix:///tmp/", "unix:///" + "x" * 200, "localhost:1", "[::1]:50051",
    "0.0.0.0:65535", "host:0", "host:65536", "localhost:\u00b2", "localhost:\u0663", "localhost:" + "9" * 5000,
    "redis://x", "http://x", "a\nb", "a\x00b", "\x1b[31m", "\ud800", "x\udcff", "\u202e", "\u00e9", "\U0001d7d8",
    "x" * 10000,
]


def scalars(text: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.sampled_from(SPECIAL_INTS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(SPECIAL_FLOATS),
        st.sampled_from(SPECIAL_TEXT),
        st.text(max_size=12) if text is None else text,
        st.dates(),
        st.binary(max_size=6),
    )


HASHABLE = st.one_of(st.text(max_size=6), st.sampled_from(["full", "swa", "tokens", "a\nb", "\ud800", ""]),
                     st.integers(-3, 3), st.none(), st.booleans(), st.floats(allow_nan=False))
VALUES = st.recursive(
    scalars(),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(HASHABLE, ch, max_size=3),
    max_leaves=6,
)


@st.composite
def near(draw: st.DrawFn, orig: Any) -> Any:
    """A value close to the original: scaled, negated, retyped, wrapped."""
    choices: list[Any] = [None, [orig], {"x": orig}, str(orig), 0, -1]
    if isinstance(orig, bool):
        choices += [not orig, int(orig)]
    elif isinstance(orig, int | float):
        k = draw(st.integers(0, 80))
        choices += [-orig, orig * 2**k, orig / 2**k, orig + 1, orig - 1, float(orig), int(orig), orig * 1.5,
                    math.nextafter(orig, math.inf), math.nextafter(orig, -math.inf), orig * (1 + 1e-10)]
    elif isinstance(orig, str):
        choices += [orig.upper(), orig + " ", orig * 2, orig[: len(orig) // 2], orig + "\n",
                    draw(st.sampled_from(SPECIAL_TEXT))]
    elif isinstance(orig, dict):
        choices += [{}, {**orig, **draw(st.dictionaries(HASHABLE, VALUES, max_size=2))}, list(orig.values())]
    elif isinstance(orig, list):
        choices += [[], orig + orig, orig[:1] * 2, tuple(orig), orig[0] if orig else None]
    return draw(st.sampled_from(choices))


# --------------------------------------------------------------------------- invariants

# Cross-key rules name one of the keys involved (and may be broken by changing the other).
CROSS_KEY = ["does not hold one page of every pool", "is below one page", "L2 must hold L1 and more",
             "pages per L1 pool", "can need a reply", "layer_first cannot serve", "required with storage.backend",
             "is not a configured component", "give both or neither", "is not a multiple of model.page_size"]


def names(msg: str, path: Path_) -> bool:
    """The message names the key: its dotted path, or its section and its own name (a
    cross-key rule like `tiers.l1 (tokens or size_gb)` or `server.tls_cert/tls_key`), or
    its section alone under `server.tokens`, where keys are hidden; a YAML syntax error
    names the line instead; a cross-key rule names one of its keys."""
    full = dotted(path)
    if full and full in msg:
        return True
    if ": not valid YAML: " in msg and "(line " in msg:
        return True
    if any(c in msg for c in CROSS_KEY):
        return True
    if any(msg.startswith(f"{dotted(path[:i])}: ") for i in range(1, len(path))):
        return True  # (the first key on the way that is wrong: `a.b.c=1` is `a: unknown key`)
    if len(path) > 1 and msg.startswith(f"{dotted(path[:-1])}."):
        return True  # (a rule between siblings: a sidecar's anchor and its sizes)
    parent, leaf = dotted(path[:-1]), path[-1]
    leaf_named = str(leaf) in msg or repr(leaf) in msg
    if parent.startswith("server.tokens") and parent in msg:
        return True
    return (not parent or parent in msg) and leaf_named


def check_outcome(build: Any, path: Path_, *, item: str | None = None) -> str:
    """Run `build()`; assert the invariant. Returns 'ok' or 'error'."""
    try:
        cfg = build()
    except ConfigError as e:
        msg = str(e)
        assert SECRET not in msg, f"a token value in the message: {msg!r}"
        assert "\n" not in msg and "\r" not in msg, f"not one line: {msg!r}"
        assert "Traceback" not in msg
        if item is not None:
            key, sep, _ = item.partition("=")
            key = key.strip()
            if sep and key and not msg.startswith("--set"):
                assert names(msg, tuple(key.split("."))), f"{item!r}: {msg!r}"
            else:
                # (a key that is not printable is quoted, to keep the message on one line)
                assert msg.startswith("--set ") and (key in msg or repr(key) in msg or not sep), \
                    f"{item!r}: {msg!r}"
        else:
            assert names(msg, path), f"mutated {dotted(path)!r}, message {msg!r}"
        return "error"
    except Exception as e:
        raise AssertionError(f"{type(e).__name__} escaped the loader for {dotted(path) or item!r}: {e!s:.300}") from e
    check_valid(cfg, path, item)
    return "ok"


def check_valid(cfg: Any, path: Path_ = (), item: str | None = None) -> None:
    """A configuration that built is whole: frozen, its derived sizes computable, what
    `config check` prints printable, and it rebuilds from its plain form to itself."""
    assert isinstance(cfg, HicacheConfig)
    with pytest.raises(AttributeError):
        cfg.model = None  # type: ignore[misc]
    try:
        l1 = cfg.l1_pages
        assert 1 <= l1 <= 2**31 - 1
        l2 = cfg.l2_pages(l1)
        assert l2 > l1, f"L2 {l2} pages, L1 {l1}: L2 must hold L1 and more"
        assert cfg.max_reply_bytes <= 2**31 - 1 and cfg.max_request_bytes > 0
        assert cfg.model.members and cfg.model.geometry
        cfg.host_layout  # noqa: B018
        text = describe(cfg)
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"built for {dotted(path) or item!r}, then {type(e).__name__}: {e!s:.300}") from e
    assert SECRET not in text
    assert build_config(to_plain(cfg)) == cfg


# --------------------------------------------------------------------------- properties

def test_every_base_is_valid_and_every_key_is_reached() -> None:
    for raw in BASES.values():
        check_valid(build_config(copy.deepcopy(raw)))
    assert build_config(DEFAULT_RAW) == build_config({})
    # every key of the embedded file is mutated, and every field of the schema (through
    # the plain form of a configuration, which lists each field, defaults included)
    assert {dotted(p) for p, _ in walk(DEFAULT_RAW)} <= {dotted(p) for p in PATHS["default"]}
    schema = {dotted(p) for p, _ in walk(to_plain(build_config(BASES["wired"])))}
    assert schema <= {dotted(p) for p in PATHS["wired/plain"]}
    assert len(DOTTED) > 60


def mutate_one(data: st.DataObject, bases: list[str], paths: dict[str, list[Path_]],
               values: Any) -> None:
    """Draw a base configuration, one of its `paths` and a value for it (`values(orig)`: a
    strategy), and check the configuration with that value there."""
    base = data.draw(st.sampled_from(bases), label="base")
    path = data.draw(st.sampled_from(paths[base]), label="path")
    value = data.draw(values(get_at(BASES[base], path)), label="value")
    check_outcome(lambda: build_config(set_at(BASES[base], path, value)), path)


@FUZZ
@given(st.data())
def test_one_key_mutated_to_any_value(data: st.DataObject) -> None:
    mutate_one(data, sorted(BASES), PATHS, lambda orig: st.one_of(VALUES, near(orig)))


LEAVES = {name: [p for p in paths if not isinstance(get_at(BASES[name], p), dict | list)] for name, paths in PATHS.items()}
SECTION_PATHS = {name: [p for p in paths if isinstance(get_at(BASES[name], p), dict | list)]
                 for name, paths in PATHS.items()}
BOUNDARY = st.one_of(
    st.sampled_from(SPECIAL_INTS + SPECIAL_FLOATS + SPECIAL_TEXT),
    st.text(st.characters(exclude_categories=()), max_size=8),  # surrogates included
)


@FUZZ
@given(st.data())
def test_one_leaf_set_to_a_boundary_value(data: st.DataObject) -> None:
    """Every leaf to each special number and string (the values where parsing breaks)."""
    mutate_one(data, sorted(BASES), LEAVES, lambda _orig: BOUNDARY)


@FUZZ
@given(st.data())
def test_an_unknown_key_at_any_level(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from(sorted(BASES)), label="base")
    section = data.draw(st.sampled_from(SECTIONS[base]), label="section")
    node = get_at(BASES[base], section)
    key = data.draw(HASHABLE.filter(lambda k: k not in node), label="key")
    value = data.draw(VALUES, label="value")
    raw = set_at(BASES[base], (*section, key), value)
    check_outcome(lambda: build_config(raw), (*section, key))


@FUZZ
@given(st.data())
def test_a_section_wrapped_or_stringified_never_shows_a_token(data: st.DataObject) -> None:
    """A section given in the wrong shape (a list of it, its YAML as a string) is an error
    about that section, and never prints the token it holds."""
    mutate_one(data, ["rich", "wired", "wired/plain"], SECTION_PATHS,
               lambda orig: st.sampled_from([[orig], yaml.safe_dump(orig), {"x": orig}, (orig,)]))


YAML_SCALARS = [
    "abc", "''", "~", "[]", "{}", "[1, 2]", "{a: 1}", "1e400", "1" + "0" * 400, "-1", "0", ".nan", ".inf", "-.inf",
    "0x10", "0o17", "0b11", "1_000", "1:30", "2024-01-01", "2020-02-30", "2024-13-01 10:00:00", "yes", "on", "'0660'",
    "0660", "!!int abc", "!!int 0x", "!!float abc", "!!bool maybe", "!!timestamp soon", "!!binary aGk=", "!!str 5",
    "!!python/object:os.system x", "!!set {a, b}", "!!omap [a: 1]", "&a [*a]", "*undefined", '"\\ud800"', '"a\\nb"',
    "'x'" + "y" * 300, "[" * 40 + "]" * 40, "{a: 1, a: 2}", "? [1]\n: 2",
]


@FUZZ
@given(st.data())
def test_set_overrides(data: st.DataObject) -> None:
    """`--set KEY=VALUE` with any dotted key (known, unknown, malformed) and any YAML value."""
    key = data.draw(st.one_of(
        st.sampled_from(DOTTED),
        st.sampled_from(["", " ", ".", "a.b.c", "tiers..l1", "tiers.", ".tiers", "model.page_size.x",
                         "server.tokens.x", "storage.file.path.x.y", "tiers.l1.tokens ", " tiers"]),
        st.text(alphabet="abl1.=_ ", max_size=12),
    ), label="key")
    value = data.draw(st.one_of(
        st.sampled_from(YAML_SCALARS),
        VALUES.map(lambda v: yaml.safe_dump(v, default_flow_style=True, width=10**9).strip()
                   if _dumpable(v) else "x"),
        st.text(max_size=16),
    ), label="value")
    sep = data.draw(st.sampled_from(["=", "=", "=", ""]), label="sep")
    item = f"{key}{sep}{value}"
    raw = copy.deepcopy(DEFAULT_RAW)

    def build() -> HicacheConfig:
        apply_override(raw, item)
        return build_config(raw)

    check_outcome(build, (), item=item)


def _dumpable(v: Any) -> bool:
    try:
        yaml.safe_dump(v)
    except (yaml.YAMLError, UnicodeEncodeError):
        return False
    return "\ud800" not in str(v)


PLACEHOLDER = "__fuzz_value__"


@FUZZ
@given(st.data())
def test_yaml_text_of_one_key(data: st.DataObject) -> None:
    """The same through a file's text (the strict loader, not `yaml.safe_load`): the
    default configuration as flow YAML with one value replaced by a YAML scalar."""
    base = data.draw(st.sampled_from(["default", "rich", "wired"]), label="base")
    path = data.draw(st.sampled_from([p for p in PATHS[base] if all(isinstance(k, str) for k in p)]), label="key")
    scalar = data.draw(st.sampled_from([s for s in YAML_SCALARS if "\n" not in s]), label="value")
    text = yaml.safe_dump(set_at(BASES[base], path, PLACEHOLDER), default_flow_style=True, width=10**9)
    text = text.replace(PLACEHOLDER, scalar)
    check_outcome(lambda: build_config(parse_yaml(text)), path)


@FUZZ
@given(st.sampled_from(["server", "server.tokens"]), st.integers(0, 200), st.booleans())
def test_a_set_override_never_shows_a_token(key: str, cut: int, garble: bool) -> None:
    tokens = f"[{{token: {SECRET}, namespaces: [a]}}, {{token: {SECRET}, namespaces: [b]}}]"
    value = f"{{tokens: {tokens}}}" if key == "server" else tokens
    value = value[:cut] + ("]]" if garble else "")
    shown = max((SECRET[:n] for n in range(len(SECRET), 5, -1) if SECRET[:n] in value), key=len, default=None)
    raw = copy.deepcopy(DEFAULT_RAW)
    try:
        apply_override(raw, f"{key}={value}")
        build_config(raw)
    except ConfigError as e:
        assert not shown or shown not in str(e), str(e)


# --------------------------------------------------------------------------- CLI

def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([HICACHE, *args], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


BAD_FILES = [
    ("tiers: {l1: {tokens: abc}}\n", "tiers.l1.tokens"),
    ("storage: {file: {bogus: 1}}\n", "storage.file.bogus"),
    ("model: {components: {full: {layers: 0}}}\n", "model.components.full.layers"),
    ("server: {tokens: [{token: " + SECRET + ", namespaces: []}]}\n", "server.tokens[0].namespaces"),
    ("tiers: 1\n", "tiers"),
]


@pytest.mark.parametrize(("text", "key"), BAD_FILES)
def test_config_check_of_a_bad_file_is_one_line_exit_2(text: str, key: str, tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    out = _cli("config", "check", str(f), tmp_path=tmp_path)
    assert out.returncode == 2, out
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and lines[0].startswith("hicache: configuration error:"), out.stderr
    assert "Traceback" not in out.stderr and SECRET not in out.stderr


BAD_SETS = [
    ("tiers.l1.tokens=abc", "tiers.l1.tokens"),
    ("a.b.c=1", "a: unknown key"),
    ("tiers=1", "tiers"),
    ("=1", "--set"),
    ("tiers.l1.tokens", "--set"),
    ("model.components={full: {layers: 0}}", "model.components.full.layers"),
]


@pytest.mark.parametrize(("item", "key"), BAD_SETS)
@pytest.mark.parametrize("command", ["serve", "config"])
def test_a_bad_set_exits_2_before_anything_starts(command: str, item: str, key: str, tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    args = (["serve", "--listen", f"unix://{sock}", "--set", "metrics.port=0"] if command == "serve"
            else ["config", "check"]) + ["--set", item]
    out = _cli(*args, tmp_path=tmp_path)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not sock.exists() and not Path(f"{sock}.lock").exists()


# --------------------------------------------------------------------------- found by the fuzzing (each failed before its fix)

def _config_error_naming(build: Any, key: str) -> str:
    with pytest.raises(ConfigError) as info:
        build()
    assert key in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("scalar", ["2020-02-30", "!!int abc", "!!bool maybe", "!!float abc", "!!timestamp soon"])
@pytest.mark.parametrize("via", ["file", "set"])
def test_a_yaml_value_that_cannot_be_constructed(scalar: str, via: str) -> None:
    if via == "file":
        _config_error_naming(lambda: parse_yaml(f"model: {{id: {scalar}}}\n"), "not valid YAML")
    else:
        _config_error_naming(lambda: apply_override({}, f"model.id={scalar}"), "model.id")


def test_deeply_nested_yaml() -> None:
    _config_error_naming(lambda: parse_yaml("model: " + "[" * 5000 + "]" * 5000 + "\n"), "not valid YAML")


def test_a_huge_integer_in_a_number_key() -> None:
    _config_error_naming(lambda: build_config({"tiers": {"l2": {"ratio": 10**400}}}), "tiers.l2.ratio")


@pytest.mark.parametrize("raw", [
    {"tiers": {"l1": {"size_gb": 1e308}}},
    {"tiers": {"l2": {"size_gb": 1e308}}},
    {"tiers": {"l2": {"ratio": 1e307}}},
])
def test_a_huge_size_gb_or_ratio(raw: dict[str, Any]) -> None:
    try:
        cfg = build_config(raw)
    except ConfigError as e:
        assert "tiers.l" in str(e)
        return
    describe(cfg)  # what `config check` prints, and the L2 sizes `serve` allocates


def test_config_check_of_a_huge_layer_count() -> None:
    raw = {"model": {"components": {"full": {"layers": 10**400, "bytes_per_token_per_layer": 1}}}}
    try:
        cfg = build_config(raw)
    except ConfigError as e:
        assert "model.components.full.layers" in str(e)
        return
    describe(cfg)


@pytest.mark.parametrize("key", ["listen", "probe_listen"])
@pytest.mark.parametrize("port", ["\u00b2", "9" * 5000])
def test_a_port_that_is_not_ascii_digits(key: str, port: str) -> None:
    _config_error_naming(lambda: build_config({"server": {key: f"localhost:{port}"}}), f"server.{key}")


@pytest.mark.parametrize("raw", [{"server": {"listen": "unix:///tmp/\ud800"}}, {"model": {"id": "m\ud800"}}])
def test_a_string_that_is_not_unicode_text(raw: dict[str, Any]) -> None:
    _config_error_naming(lambda: build_config(raw), next(iter(raw)))


@pytest.mark.parametrize("build", [
    lambda: build_config({"server": [{"tokens": [{"token": SECRET, "namespaces": ["a"]}]}]}),
    lambda: apply_override({}, f"server={{tokens: [{{token: {SECRET}, namespaces: [a]}}]"),
    lambda: parse_yaml(f"server:\n  tokens:\n    - {{{SECRET}: [a], {SECRET}: [b]}}\n"),
])
def test_a_token_shown_in_an_error(build: Any) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert SECRET not in str(info.value), str(info.value)


@pytest.mark.parametrize("raw", [{"tiers": {"a\nb": 1}}, {"model": {"sidecars": {"a\nb": 5}}}])
def test_an_error_about_a_key_with_a_newline_is_one_line(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("item", [".=1", "tiers..l1=1", " =1"])
def test_a_set_key_with_an_empty_segment(item: str) -> None:
    msg = _config_error_naming(lambda: load_config(overrides=[item], env={}), "--set")
    assert item.partition("=")[0] in msg


def test_a_set_value_with_a_duplicate_key() -> None:
    item = "model.components={full: {layers: 1, bytes_per_token_per_layer: 8}, full: {layers: 2, bytes_per_token_per_layer: 8}}"
    _config_error_naming(lambda: load_config(overrides=[item], env={}), "duplicate key")


@pytest.mark.parametrize("raw", [
    {"tiers": {"l2": {"ratio": 1.0000000001}}},
    {"tiers": {"l1": {"tokens": 64}, "l2": {"ratio": 1.0000001}}},
])
def test_a_ratio_just_over_1_gives_an_l2_no_larger_than_l1(raw: dict[str, Any]) -> None:
    try:
        cfg = build_config(raw)
    except ConfigError as e:
        assert "tiers.l2.ratio" in str(e)
        return
    assert cfg.l2_pages(cfg.l1_pages) > cfg.l1_pages


@pytest.mark.parametrize("args", [
    ["config", "check", "--set", "model.id=2020-02-30"],
    ["serve", "--listen", "localhost:\u00b2"],
])
def test_cli_tracebacks(args: list[str], tmp_path: Path) -> None:
    out = _cli(*args, tmp_path=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-500:]
