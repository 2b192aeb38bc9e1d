"""deploy/ parses, and its ports, paths and configuration keys are the code's.

Each manifest is read the way its consumer reads it (YAML documents, a systemd unit, an
environment file, a Dockerfile) and checked against hicache.config, the embedded
hicache.yaml, the generated gRPC descriptors and pyproject.toml.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from hicache.config import (
    MOONCAKE_ENV,
    HicacheConfig,
    apply_env,
    apply_override,
    build_config,
    load_config,
    parse_yaml,
)
from hicache.pb.hicache.v1 import admin_pb2, hicache_pb2
from hicache.types import StorageBackendName

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "hicache.service"
ENV_FILE = DEPLOY / "systemd" / "hicache.env"
DOCKERFILE = DEPLOY / "Dockerfile"

# The kubelet's grpc probes need a TCP listener beside the unix socket: `server.probe_listen`.
PROBE_KEY = "probe_listen"
SAMPLE_POD_IP = "10.1.2.3"

Doc = dict[str, Any]


# --------------------------------------------------------------------------- readers


@cache
def k8s_docs(name: str) -> tuple[Doc, ...]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert docs, f"{name}: no YAML documents"
    return tuple(docs)


def k8s(kind: str, name: str) -> Doc:
    found = [
        d
        for path in sorted(K8S.glob("*.yaml"))
        for d in k8s_docs(path.name)
        if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"expected one {kind}/{name} under deploy/k8s, found {len(found)}"
    return found[0]


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a unit line: {raw!r}"
        current.append((key.strip(), value.strip()))
    assert not pending, "unit ends inside a continued line"
    return sections


@cache
def unit() -> dict[str, list[tuple[str, str]]]:
    return parse_unit(UNIT.read_text())


def unit_value(section: str, key: str) -> str:
    values = [v for k, v in unit()[section] if k == key]
    assert len(values) == 1, f"[{section}] {key}: expected once, found {values}"
    return values[0]


def parse_env_file(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(variables set, variables documented in `#NAME=value` comments)."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(#)?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            (commented if match.group(1) else active)[match.group(2)] = match.group(3)
    return active, commented


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def dockerfile(instruction: str) -> list[str]:
    return [a for i, a in parse_dockerfile(DOCKERFILE.read_text()) if i == instruction]


# --------------------------------------------------------------------------- the daemon pod


def daemonset() -> Doc:
    return k8s("DaemonSet", "hicache")


def pod_spec() -> Doc:
    spec: Doc = daemonset()["spec"]["template"]["spec"]
    return spec


def container(spec: Doc, name: str) -> Doc:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def daemon() -> Doc:
    return container(pod_spec(), "hicache")


def env_of(c: Doc) -> dict[str, str]:
    """A container's environment; fieldRef values get sample values."""
    out: dict[str, str] = {}
    for var in c.get("env", []):
        if "value" in var:
            out[var["name"]] = str(var["value"])
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            out[var["name"]] = SAMPLE_POD_IP
        else:
            raise AssertionError(f"env {var['name']}: unsupported source {var}")
    return out


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg)


def daemon_args() -> tuple[str, list[str]]:
    """(--config path, [--set overrides]) of the daemon container, expanded."""
    env = env_of(daemon())
    args = [expand(a, env) for a in daemon()["args"]]
    config_path: str | None = None
    overrides: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "--config":
            config_path = next(it)
        elif arg == "--set":
            overrides.append(next(it))
        else:
            raise AssertionError(f"daemon arg {arg!r} is not one hicache serve takes here")
    assert config_path is not None, "the daemon needs --config"
    return config_path, overrides


def configmap_text() -> str:
    text: str = k8s("ConfigMap", "hicache-config")["data"]["hicache.yaml"]
    return text


@cache
def daemon_config() -> tuple[HicacheConfig, str]:
    """The configuration the daemon pod resolves (file + --set + environment, as
    load_config does), and its probe listen address."""
    raw = parse_yaml(configmap_text(), "configmap hicache.yaml")
    for item in daemon_args()[1]:
        apply_override(raw, item)
    apply_env(raw, env_of(daemon()))
    probe = raw.get("server", {}).get(PROBE_KEY)
    assert isinstance(probe, str), f"configmap: server.{PROBE_KEY} must be host:port"
    cfg = build_config(raw)
    probe = getattr(cfg.server, PROBE_KEY)
    return cfg, probe


def probe_port() -> int:
    host, _, port = daemon_config()[1].rpartition(":")
    assert host and port.isdigit(), daemon_config()[1]
    return int(port)


def named_port(c: Doc, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    assert isinstance(port, int)
    return port


def quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return int(q.removesuffix(suffix)) * factor
    return int(q)


# --------------------------------------------------------------------------- parsing


def _deploy_files() -> Iterator[Path]:
    yield from sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def test_every_file_under_deploy_is_parsed() -> None:
    seen = set()
    for path in _deploy_files():
        rel = path.relative_to(DEPLOY).as_posix()
        if path.suffix == ".yaml":
            for doc in k8s_docs(path.name):
                assert {"apiVersion", "kind", "metadata"} <= set(doc), rel
                assert doc["metadata"]["name"], rel
                assert doc["metadata"].get("namespace") == "hicache", rel
        elif path.suffix == ".service":
            assert {"Unit", "Service", "Install"} <= set(parse_unit(path.read_text())), rel
        elif path.suffix == ".env":
            active, commented = parse_env_file(path.read_text())
            assert active or commented, rel
        elif path.name == "Dockerfile":
            assert parse_dockerfile(path.read_text())[0][0] == "FROM", rel
        else:
            raise AssertionError(f"deploy/{rel}: no parser for this kind of file")
        seen.add(rel)
    assert seen == {
        "Dockerfile", "k8s/configmap.yaml", "k8s/daemonset.yaml", "k8s/mooncake-master.yaml",
        "k8s/networkpolicy.yaml", "systemd/hicache.env", "systemd/hicache.service",
    }


def test_unit_parser_handles_repeats_and_continuations() -> None:
    parsed = parse_unit("[Service]\n# c\nA=1\nA=2\nExecStart=/bin/x \\\n  --y\n")
    assert parsed == {"Service": [("A", "1"), ("A", "2"), ("ExecStart", "/bin/x --y")]}


# --------------------------------------------------------------------------- k8s: config


def test_configmap_validates_unmodified() -> None:
    raw = parse_yaml(configmap_text())
    apply_env(raw, env_of(daemon()))
    build_config(raw)


def test_configmap_config_is_the_daemons() -> None:
    cfg, _ = daemon_config()
    assert cfg.storage.backend is StorageBackendName.MOONCAKE
    assert cfg.storage.mooncake.local_hostname == SAMPLE_POD_IP
    assert cfg.server.listen.startswith("unix://")


def test_config_file_is_the_mounted_configmap() -> None:
    config_path = PurePosixPath(daemon_args()[0])
    (mount,) = [m for m in daemon()["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in pod_spec()["volumes"] if v["name"] == "config"]
    assert PurePosixPath(mount["mountPath"]) == config_path.parent
    assert mount.get("readOnly") is True
    assert volume["configMap"]["name"] == "hicache-config"
    assert config_path.name in k8s("ConfigMap", "hicache-config")["data"]


def test_mooncake_keys_come_from_the_environment_only() -> None:
    env = env_of(daemon())
    mooncake_vars = {v for v in env if v.startswith("MOONCAKE_")}
    assert mooncake_vars <= set(MOONCAKE_ENV.values())
    section = parse_yaml(configmap_text()).get("storage", {}).get("mooncake", {})
    shadowed = {k for k, var in MOONCAKE_ENV.items() if var in env and section.get(k)}
    # A key in the file wins over the environment, silently.
    assert shadowed == set()


# --------------------------------------------------------------------------- k8s: ports, paths


def test_metrics_port_annotation_matches_config() -> None:
    cfg, _ = daemon_config()
    annotations = daemonset()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(cfg.metrics.port)
    assert named_port(daemon(), "metrics") == cfg.metrics.port
    assert cfg.metrics.port != 0


def test_grpc_probes_use_the_tcp_health_listener() -> None:
    port = probe_port()
    assert named_port(daemon(), "grpc-probe") == port
    services = {
        s.full_name
        for module in (hicache_pb2, admin_pb2)
        for s in module.DESCRIPTOR.services_by_name.values()
    }
    probes = {k: daemon()[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    for kind, probe in probes.items():
        assert set(probe) & {"grpc", "exec", "httpGet", "tcpSocket"} == {"grpc"}, kind
        assert probe["grpc"]["port"] == port, kind
        service = probe["grpc"].get("service", "")
        assert service == "" or service in services, f"{kind}: unknown service {service!r}"
    # Readiness follows the overall status (NOT_SERVING while a required backend is down);
    # liveness must not, or a storage outage would restart every daemon.
    assert probes["readinessProbe"]["grpc"].get("service", "") == ""
    assert probes["livenessProbe"]["grpc"].get("service", "") != ""


def test_socket_dir_is_the_shared_host_path() -> None:
    cfg, _ = daemon_config()
    socket = PurePosixPath(cfg.server.listen.removeprefix("unix://"))
    (mount,) = [m for m in daemon()["volumeMounts"] if PurePosixPath(m["mountPath"]) == socket.parent]
    (volume,) = [v for v in pod_spec()["volumes"] if v["name"] == mount["name"]]
    assert PurePosixPath(volume["hostPath"]["path"]) == socket.parent
    assert not mount.get("readOnly", False)
    # The init container hands that directory to the daemon's user.
    (init,) = pod_spec()["initContainers"]
    assert [m["mountPath"] for m in init["volumeMounts"] if m["name"] == mount["name"]] == [
        str(socket.parent)
    ]
    uid = pod_spec()["securityContext"]["runAsUser"]
    gid = pod_spec()["securityContext"]["runAsGroup"]
    assert f"chown {uid}:{gid} {socket.parent}" in " ".join(init["command"])


def test_pod_can_share_l1_pools_and_stays_unprivileged() -> None:
    spec = pod_spec()
    assert spec["hostIPC"] is True
    assert not spec.get("hostNetwork", False)
    assert spec["securityContext"]["runAsNonRoot"] is True
    sc = daemon()["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc.get("privileged", False)


def test_grace_period_exceeds_the_longest_stop() -> None:
    """Grace for in-flight calls, the flush, and the close's wait for a hung store."""
    from hicache.server import longest_stop_s

    cfg, _ = daemon_config()
    assert pod_spec()["terminationGracePeriodSeconds"] > longest_stop_s(cfg)


def test_memory_limit_covers_l2_and_the_mooncake_segment() -> None:
    """L2 as the host pools size it (a page_first slot's header and padding too) and the
    segment lent to Mooncake. (L1 is on the GPU: the DaemonSet runs on GPU nodes.)"""
    from hicache.tiers.sizing import host_pages, slot_bytes

    cfg, _ = daemon_config()
    pages = host_pages(cfg)
    l2_bytes = sum(pages[m.component] * slot_bytes(m, cfg.host_layout) for m in cfg.model.members)
    lent = cfg.storage.mooncake.global_segment_size + cfg.storage.mooncake.local_buffer_size
    limit = quantity_bytes(daemon()["resources"]["limits"]["memory"])
    assert limit >= l2_bytes + lent, (limit, l2_bytes, lent)


# --------------------------------------------------------------------------- k8s: Mooncake


def master_flags() -> dict[str, str]:
    c = container(k8s("Deployment", "mooncake-master")["spec"]["template"]["spec"],
                  "mooncake-master")
    assert c["command"] == ["mooncake_master"]
    flags: dict[str, str] = {}
    for arg in c["args"]:
        key, sep, value = arg.partition("=")
        assert sep and key.startswith("--"), arg
        flags[key[2:]] = value
    return flags


def service_port(service: Doc, port: int) -> int:
    """The master container port a Service port leads to."""
    deployment = k8s("Deployment", "mooncake-master")
    c = container(deployment["spec"]["template"]["spec"], "mooncake-master")
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    target = entry.get("targetPort", port)
    return named_port(c, target) if isinstance(target, str) else int(target)


def test_mooncake_environment_points_at_the_master_service() -> None:
    flags = master_flags()
    service = k8s("Service", "mooncake-master")
    deployment = k8s("Deployment", "mooncake-master")
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    env = env_of(daemon())

    master_host, _, master_port = env["MOONCAKE_MASTER"].rpartition(":")
    assert master_host == host
    assert service_port(service, int(master_port)) == int(flags["rpc_port"])

    meta = urlsplit(env["MOONCAKE_TE_META_DATA_SERVER"])
    assert (meta.scheme, meta.hostname, meta.path) == ("http", host, "/metadata")
    assert meta.port is not None
    assert flags["enable_http_metadata_server"] == "true"
    assert flags["http_metadata_server_host"] == "0.0.0.0"
    assert service_port(service, meta.port) == int(flags["http_metadata_server_port"])

    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == flags["metrics_port"]
    assert service_port(service, int(flags["metrics_port"])) == int(flags["metrics_port"])

    cfg, _ = daemon_config()
    assert cfg.storage.mooncake.master == env["MOONCAKE_MASTER"]
    assert cfg.storage.mooncake.metadata_server == env["MOONCAKE_TE_META_DATA_SERVER"]


# --------------------------------------------------------------------------- systemd


def exec_start() -> list[str]:
    return shlex.split(unit_value("Service", "ExecStart"))


def env_file_args() -> list[str]:
    active, _ = parse_env_file(ENV_FILE.read_text())
    return active.get("HICACHE_ARGS", "").split()


def unit_overrides() -> list[str]:
    """`--listen` and every `--set` the unit passes, as config overrides."""
    words = [w for w in exec_start() if w != "$HICACHE_ARGS"] + env_file_args()
    assert "$HICACHE_ARGS" in exec_start()
    out: list[str] = []
    it = iter(words[2:])
    assert words[1] == "serve", words
    for word in it:
        if word == "--listen":
            out.append(f"server.listen={next(it)}")
        elif word == "--set":
            out.append(next(it))
        elif word == "--config":
            next(it)
        else:
            raise AssertionError(f"ExecStart: unexpected argument {word!r}")
    return out


def test_unit_hardening() -> None:
    expected = {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "LimitMEMLOCK": "infinity", "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes", "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes", "SystemCallArchitectures": "native",
    }
    service = dict(unit()["Service"])
    assert {k: service.get(k) for k in expected} == expected
    # The L1 pools are shared with engines through /dev/shm and /dev/nvidia*.
    assert service.get("PrivateDevices", "no") == "no"
    assert service["User"] != "root" or service.get("DynamicUser") == "yes"


def test_unit_socket_lives_in_its_runtime_directory() -> None:
    words = exec_start()
    listen = words[words.index("--listen") + 1]
    socket = PurePosixPath(listen.removeprefix("unix://"))
    assert listen.startswith("unix://")
    assert socket.parent == PurePosixPath("/run") / unit_value("Service", "RuntimeDirectory")


def test_unit_paths_are_its_managed_directories() -> None:
    words = exec_start()
    etc = PurePosixPath("/etc") / unit_value("Service", "ConfigurationDirectory")
    assert PurePosixPath(words[words.index("--config") + 1]).parent == etc
    assert PurePosixPath(unit_value("Service", "EnvironmentFile").lstrip("-")).parent == etc
    cfg = load_config(None, unit_overrides(), env={})
    cache_dir = PurePosixPath("/var/cache") / unit_value("Service", "CacheDirectory")
    assert PurePosixPath(cfg.storage.file.path).parent == cache_dir.parent
    assert PurePosixPath(cfg.storage.file.path).is_relative_to(cache_dir)


def test_unit_stop_timeout_exceeds_the_longest_stop() -> None:
    from hicache.server import longest_stop_s

    cfg = load_config(None, unit_overrides(), env={})
    assert int(unit_value("Service", "TimeoutStopSec")) > longest_stop_s(cfg)
    assert unit_value("Service", "KillSignal") == "SIGTERM"


def test_env_file_documents_every_mooncake_variable() -> None:
    active, commented = parse_env_file(ENV_FILE.read_text())
    assert {v for v in active if v.startswith("MOONCAKE_")} == set()
    assert {v for v in commented if v.startswith("MOONCAKE_")} == set(MOONCAKE_ENV.values())
    # Uncommented, the examples configure a valid Mooncake backend.
    cfg = load_config(None, [*unit_overrides(), "storage.backend=mooncake"], env=commented)
    assert cfg.storage.mooncake.master == commented["MOONCAKE_MASTER"]
    assert cfg.storage.mooncake.global_segment_size == int(
        commented["MOONCAKE_GLOBAL_SEGMENT_SIZE"]
    )


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_base_libs_user_and_entrypoint() -> None:
    assert dockerfile("FROM") == ["python:3.11-slim-bookworm"]
    apt = " ".join(a for a in dockerfile("RUN") if "apt-get install" in a).split()
    assert {"libibverbs1", "librdmacm1", "libnuma1", "libcurl4"} <= set(apt)  # Mooncake's
    (user,) = dockerfile("USER")
    uid, _, gid = user.partition(":")
    assert int(uid) == pod_spec()["securityContext"]["runAsUser"] != 0
    assert int(gid) == pod_spec()["securityContext"]["runAsGroup"]
    (entrypoint,) = dockerfile("ENTRYPOINT")
    assert yaml.safe_load(entrypoint) == ["hicache", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "hicache" in scripts


def test_dockerfile_exposes_the_configured_ports() -> None:
    cfg, _ = daemon_config()
    exposed = {int(p.split("/")[0]) for line in dockerfile("EXPOSE") for p in line.split()}
    assert exposed == {cfg.metrics.port, probe_port()}


def test_dockerfile_copies_every_package_source() -> None:
    copied: set[str] = set()
    for args in dockerfile("COPY"):
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            copied.add(PurePosixPath(source).parts[0])
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    # hicache/hicache.yaml (the embedded defaults) links to the root file: COPY keeps the
    # link, so the target must be copied too or the wheel ships without it.
    link = ROOT / "hicache" / "hicache.yaml"
    if link.is_symlink():
        assert link.resolve().relative_to(ROOT.resolve()).parts[0] in copied

