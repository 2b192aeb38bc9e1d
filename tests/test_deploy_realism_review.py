"""Review: would deploy/ actually work, and is it safe?

tests/test_deploy.py checks that the manifests parse and that their ports, paths and keys
are the code's. These tests run the daemon the way the deploy files run it, as far as this
machine allows (no docker, no kubelet, no systemd as PID 1):

- the DaemonSet pod and the mooncake-master pod, emulated in a private mount and network
  namespace: a read-only root, the securityContext's uid/gid, the init container's own
  command on a root-owned /run/hicache, an emptyDir /tmp, the Deployment's exact flags and
  ports, the DaemonSet's exact args and environment (the Service's DNS name resolves to
  the pod IP through /etc/hosts), kubelet-style grpc probes on the manifest's port and
  services, Prometheus at the annotated port and path, an engine with
  `supplementalGroups: [10001]` and an outsider without;
- the systemd unit, emulated likewise: its ExecStart with $HICACHE_ARGS split as systemd
  splits it, User/Group, UMask, RuntimeDirectory/CacheDirectory modes, ProtectSystem=strict
  (a read-only root with only those two directories writable), PrivateTmp; under strace,
  so that every system call and socket family the daemon uses is compared with the unit's
  SystemCallFilter= and RestrictAddressFamilies=;
- the image: a wheel built from exactly what the Dockerfile COPYs, and its ENTRYPOINT run
  as its USER with its ENV in Docker's default 64 MiB /dev/shm.

Tiers and the Mooncake segment are shrunk where the manifests size them for a 141 GiB GPU
node (`SHRINK`); everything else is the files' own. A test that exposes a problem of the
deploy files is a strict xfail whose reason starts with BUG.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import zipfile
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import test_deploy as deploy  # (the manifest readers; a module import: none of its tests)
import yaml

ROOT = deploy.ROOT
VENV_BIN = Path(sys.executable).parent
HICACHE = VENV_BIN / "hicache"
POD_IP = "10.1.2.3"
# The manifests size L1/L2 for Llama-3-8B on a GPU node (8 + 32 GiB) and lend 4 GiB to
# Mooncake: shrunk here, nothing else changed.
# (and the GPU nodes' CUDA L1 in shared memory: this machine has no GPU)
SHRINK = ["--set", "tiers.l1.tokens=4096", "--set", "storage.mooncake.local_buffer_size=16777216",
          "--set", "tiers.l1.device=shm"]
SHRUNK_SEGMENT = str(64 << 20)
ENGINE_UID = 20000
OUTSIDER_UID = 20001
PYTHON_HOME = str(Path(sys.base_prefix).resolve())


# --------------------------------------------------------------------------- helpers


def run(argv: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


@cache
def namespaces_work() -> str:
    """'' when this machine lets root make private mount + network namespaces with a veth
    pair and drop to another uid (what the emulations need); else why not."""
    for tool in ("unshare", "setpriv", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if os.geteuid() != 0:
        return "not root"
    probe = run(["unshare", "-m", "-n", "--fork", "sh", "-c",
                 "mount -t tmpfs tmpfs /tmp && ip link add veth0 type veth peer name eth0 && "
                 "setpriv --reuid 10001 --regid 10001 --clear-groups true"], timeout=30)
    return "" if probe.returncode == 0 else f"namespaces unavailable: {probe.stderr.strip()}"


def need_namespaces() -> None:
    why = namespaces_work()
    if why:
        pytest.skip(why)


def in_namespaces(script: str, spec: dict[str, Any], tmp_path: Path, timeout: float) -> dict[str, Any]:
    """Run `script` (Python) as root in fresh mount + network namespaces with `spec` as
    JSON on argv[1]; it prints one JSON object as its last stdout line."""
    src = tmp_path / "orchestrate.py"
    src.write_text(textwrap.dedent(script))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    proc = run(["unshare", "-m", "-n", "--fork", sys.executable, str(src), str(spec_file)],
               timeout=timeout, cwd="/")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# The common part of both emulations (runs inside the namespaces, as root).
ORCHESTRATE_COMMON = """
import json, os, signal, subprocess, sys, time, urllib.request
spec = json.load(open(sys.argv[1]))
def sh(*cmd):
    subprocess.run(cmd, check=True)
def up_network(ip):
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", "veth0", "type", "veth", "peer", "name", "eth0")
    sh("ip", "addr", "add", ip + "/24", "dev", "eth0")
    sh("ip", "link", "set", "veth0", "up")
    sh("ip", "link", "set", "eth0", "up")
def as_user(uid, gid, groups, argv, umask=None, **kw):
    grp = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    pre = ["setpriv", "--reuid", str(uid), "--regid", str(gid), *grp]
    if umask is not None:
        pre += ["sh", "-c", 'umask %s; exec "$@"' % umask, "sh"]
    return pre + list(argv)
def wait_for(path, proc, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False
def health(uid, gid, groups, target):
    p = subprocess.run(as_user(uid, gid, groups, [spec["hicache"], "health", "--json", "--target", target]),
                       capture_output=True, text=True, timeout=30)
    try:
        report = json.loads(p.stdout)
    except ValueError:
        report = {"raw": p.stdout + p.stderr}
    return {"rc": p.returncode, "report": report}
def stat_of(path):
    st = os.stat(path)
    return {"mode": oct(st.st_mode & 0o7777), "uid": st.st_uid, "gid": st.st_gid}
def expose_python(home):
    # This machine's interpreter lives under /root (0700), which the other uids may not
    # pass once traced or exec-ed by sh: /root becomes an empty 0755 tmpfs holding it only
    # (where an image or /opt/hicache has it readable anyway).
    if not home.startswith("/root/"):
        return
    sh("mount", "-t", "tmpfs", "tmpfs", "/tmp")  # (private: the scripts mount their own /tmp later)
    stage = "/tmp/python"
    os.makedirs(stage)
    sh("mount", "--bind", home, stage)
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/root")
    os.makedirs(home)
    sh("mount", "--bind", stage, home)
def stop(proc, seconds):
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed"
    return rc, time.monotonic() - started
"""


# --------------------------------------------------------------------------- k8s: config


def daemonset_env() -> dict[str, str]:
    return deploy.env_of(deploy.daemon())


def configmap_file(tmp_path: Path) -> Path:
    path = tmp_path / "hicache.yaml"
    path.write_text(deploy.configmap_text())
    return path


def test_configmap_passes_config_check_with_the_daemonsets_args_and_env(tmp_path: Path) -> None:
    """`hicache config check` (what the ConfigMap's header tells operators to run) accepts
    the file with the DaemonSet's --set and MOONCAKE_* variables, and prints the sizes the
    comments promise (8 GiB of GPU L1, 32 GiB of L2)."""
    env = {**os.environ, **daemonset_env()}
    _, overrides = deploy.daemon_args()
    sets = [a for o in overrides for a in ("--set", o)]
    proc = run([str(HICACHE), "config", "check", str(configmap_file(tmp_path)), *sets], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "l1_bytes: 8.0 GiB" in proc.stdout
    assert re.search(r"l2_bytes: 32\.0 GiB", proc.stdout), proc.stdout
    assert f"local_hostname: {deploy.SAMPLE_POD_IP}" in proc.stdout
    # Without the DaemonSet's environment the file alone is refused, naming the variable.
    bare = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    proc = run([str(HICACHE), "config", "check", str(configmap_file(tmp_path)), *sets], env=bare)
    assert proc.returncode == 2 and "MOONCAKE_MASTER" in proc.stderr, proc.stderr


def test_memory_limit_also_covers_a_shared_memory_l1() -> None:
    """The nodeSelector says "drop on CPU-only clusters", and a GPU node whose runtime
    ignores NVIDIA_VISIBLE_DEVICES leaves the daemon without CUDA: L1 then lives in the
    node's /dev/shm (hostIPC), whose pages are charged to this pod's memory cgroup. The
    limit still covers L1 + L2 + the Mooncake segment and buffer."""
    from hicache.tiers.sizing import host_pages, slot_bytes

    cfg, _ = deploy.daemon_config()
    l1 = sum(cfg.pages_for(m.component) * m.bytes_per_page for m in cfg.model.members)
    pages = host_pages(cfg)
    l2 = sum(pages[m.component] * slot_bytes(m, cfg.host_layout) for m in cfg.model.members)
    lent = cfg.storage.mooncake.global_segment_size + cfg.storage.mooncake.local_buffer_size
    limit = deploy.quantity_bytes(deploy.daemon()["resources"]["limits"]["memory"])
    assert l1 + l2 + lent + (1 << 30) <= limit, (l1, l2, lent, limit)  # 1 GiB: the process


def test_pod_dev_shm_is_not_the_64_mib_default() -> None:
    """A pod's own /dev/shm is 64 MiB unless an emptyDir of medium Memory is mounted
    there; the DaemonSet takes the node's instead (hostIPC), which also lets engines open
    the segments."""
    spec = deploy.pod_spec()
    mounts = [m for m in deploy.daemon()["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert spec.get("hostIPC") is True or mounts
    assert not mounts, "with hostIPC, an emptyDir on /dev/shm would hide the node's"


# --------------------------------------------------------------------------- k8s: the pods, run

POD_SCRIPT = ORCHESTRATE_COMMON + """
up_network(spec["pod_ip"])
expose_python(spec["python_home"])
# The node: /run is a tmpfs; kubelet's DirectoryOrCreate makes the hostPath root-owned 0755.
sh("mount", "-t", "tmpfs", "tmpfs", "/run")
os.makedirs(spec["socket_dir"], mode=0o755)
# The ConfigMap volume (read-only), /etc/hosts with the Service's name, the emptyDirs.
os.makedirs("/run/cm")
open("/run/cm/" + spec["config_name"], "w").write(spec["config_text"])
sh("mount", "--bind", "/run/cm", "/run/cm")
sh("mount", "-o", "remount,bind,ro", "/run/cm")
hosts = open("/etc/hosts").read() + "\\n%s %s\\n" % (spec["pod_ip"], spec["service_host"])
open("/run/hosts", "w").write(hosts)
sh("mount", "--bind", "/run/hosts", "/etc/hosts")
sh("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp")
sh("mount", "-t", "tmpfs", "-o", "mode=1777,size=1g", "tmpfs", "/dev/shm")  # (hostIPC: the node's)
sh("mount", "-o", "remount,bind,ro", "/")  # readOnlyRootFilesystem
out = {"root_read_only": subprocess.run(["touch", "/usr/.rw_probe"], capture_output=True).returncode != 0}
# The init container: root with CHOWN and FOWNER only, no new privileges.
init = subprocess.run(["setpriv", "--bounding-set", "-all," + ",".join("+" + c.lower() for c in spec["init_caps"]),
                       "--no-new-privs", *spec["init_command"]], capture_output=True, text=True)
out["init_rc"] = init.returncode
out["socket_dir"] = stat_of(spec["socket_dir"])
env = {"PATH": os.environ["PATH"], **spec["image_env"]}
uid, gid = spec["uid"], spec["gid"]
master = subprocess.Popen(as_user(uid, gid, [], spec["master_argv"]), env=env,
                          stdout=open("/tmp/master.log", "w"), stderr=subprocess.STDOUT, cwd="/")
import socket
for _ in range(100):
    try:
        socket.create_connection((spec["pod_ip"], spec["master_port"]), 0.2).close()
        break
    except OSError:
        time.sleep(0.1)
daemon = subprocess.Popen(as_user(uid, gid, [], spec["daemon_argv"]), env={**env, **spec["daemon_env"]},
                          stdout=open("/tmp/daemon.log", "w"), stderr=subprocess.STDOUT, cwd="/")
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel("%s:%d" % (spec["pod_ip"], spec["probe_port"])))
probes = {}
deadline = time.monotonic() + 60
while time.monotonic() < deadline and daemon.poll() is None:
    try:
        stub.Check(health_pb2.HealthCheckRequest(service=spec["probes"]["startupProbe"]), timeout=2)
        break
    except grpc.RpcError:
        time.sleep(0.2)
for kind, service in spec["probes"].items():  # what the kubelet sends: Check(service)
    try:
        probes[kind] = health_pb2.HealthCheckResponse.ServingStatus.Name(
            stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)
    except grpc.RpcError as e:
        probes[kind] = e.code().name
out["probes"] = probes
try:
    body = urllib.request.urlopen("http://%s:%d%s" % (spec["pod_ip"], spec["metrics_port"], spec["metrics_path"]),
                                  timeout=5).read().decode()
    out["metrics_ok"] = "hicache_" in body
except OSError as e:
    out["metrics_ok"] = repr(e)
time.sleep(1.0)  # (the backend's first health report)
out["socket"] = stat_of(spec["socket"]) if os.path.exists(spec["socket"]) else None
out["engine"] = health(spec["engine_uid"], spec["engine_uid"], [gid], "unix://" + spec["socket"])
out["outsider"] = health(spec["outsider_uid"], spec["outsider_uid"], [], "unix://" + spec["socket"])
out["daemon_rc"], out["stop_s"] = stop(daemon, spec["grace_s"])
stop(master, 10)
out["daemon_log_tail"] = open("/tmp/daemon.log").read()[-1500:]
print(json.dumps(out))
"""


def test_daemonset_and_master_pods_emulated(tmp_path: Path) -> None:
    """The two pods as their manifests run them (see the module docstring): both start
    as uid 10001 on a read-only root, the kubelet's grpc probes on the probe port get
    SERVING for each probe's service, Prometheus scrapes the annotated port and path,
    the daemon reaches mooncake-master through the Service's name, an engine in group 10001
    connects over the hostPath socket and an outsider is refused, and SIGTERM ends the
    daemon cleanly within terminationGracePeriodSeconds."""
    need_namespaces()
    pod = deploy.pod_spec()
    sc = pod["securityContext"]
    env = daemonset_env()
    env["POD_IP"] = POD_IP
    env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = SHRUNK_SEGMENT
    cfg_path, _ = deploy.daemon_args()
    args = [deploy.expand(a, env) for a in deploy.daemon()["args"]]
    (entrypoint,) = deploy.dockerfile("ENTRYPOINT")
    daemon_argv = [str(VENV_BIN / w) if i == 0 else w for i, w in enumerate(yaml.safe_load(entrypoint))]
    cfg, _ = deploy.daemon_config()
    socket_path = cfg.server.listen.removeprefix("unix://")
    master_c = deploy.container(deploy.k8s("Deployment", "mooncake-master")["spec"]["template"]["spec"],
                                "mooncake-master")
    flags = deploy.master_flags()
    service_host = env["MOONCAKE_MASTER"].rpartition(":")[0]
    (init,) = pod["initContainers"]
    annotations = deploy.daemonset()["spec"]["template"]["metadata"]["annotations"]
    image_env = {}
    for line in deploy.dockerfile("ENV"):
        for word in shlex.split(line):
            key, _, value = word.partition("=")
            image_env[key] = value
    spec = {
        "hicache": str(HICACHE),
        "pod_ip": POD_IP,
        "uid": sc["runAsUser"], "gid": sc["runAsGroup"],
        "socket_dir": str(PurePosixPath(socket_path).parent), "socket": socket_path,
        "config_name": PurePosixPath(cfg_path).name, "config_text": deploy.configmap_text(),
        "service_host": service_host,
        "init_command": init["command"], "init_caps": init["securityContext"]["capabilities"]["add"],
        "image_env": image_env,
        "master_argv": [str(VENV_BIN / master_c["command"][0]), *master_c["args"]],
        "master_port": int(flags["rpc_port"]),
        "daemon_argv": [*daemon_argv, *[a.replace(cfg_path, f"/run/cm/{PurePosixPath(cfg_path).name}")
                                        for a in args], *SHRINK],
        "daemon_env": env,
        "probe_port": deploy.probe_port(),
        "probes": {k: deploy.daemon()[k]["grpc"].get("service", "")
                   for k in ("startupProbe", "livenessProbe", "readinessProbe")},
        "metrics_port": int(annotations["prometheus.io/port"]),
        "metrics_path": annotations["prometheus.io/path"],
        "engine_uid": ENGINE_UID, "outsider_uid": OUTSIDER_UID,
        "grace_s": pod["terminationGracePeriodSeconds"], "python_home": PYTHON_HOME,
    }
    out = in_namespaces(POD_SCRIPT, spec, tmp_path, timeout=120)
    assert out["root_read_only"]
    assert out["init_rc"] == 0
    assert out["socket_dir"] == {"mode": "0o750", "uid": sc["runAsUser"], "gid": sc["runAsGroup"]}
    assert out["probes"] == dict.fromkeys(spec["probes"], "SERVING"), out
    assert out["metrics_ok"] is True, out
    assert out["socket"] == {"mode": "0o660", "uid": sc["runAsUser"], "gid": sc["runAsGroup"]}, out
    engine = out["engine"]
    assert engine["rc"] == 0, out  # SERVING, and the Mooncake backend healthy
    assert [b["name"] for b in engine["report"]["backends"]] == ["mooncake"]
    assert out["outsider"]["rc"] == 2, out  # unreachable: the socket's mode refuses it
    assert out["daemon_rc"] == 0 and out["stop_s"] < spec["grace_s"], out


# --------------------------------------------------------------------------- k8s: safety


def test_k8s_restricts_who_reaches_the_unauthenticated_mooncake_ports() -> None:
    policies = [d for path in sorted(deploy.K8S.glob("*.yaml")) for d in deploy.k8s_docs(path.name)
                if d["kind"] == "NetworkPolicy"]
    master_labels = deploy.k8s("Deployment", "mooncake-master")["spec"]["template"]["metadata"]["labels"]
    daemon_labels = deploy.daemonset()["spec"]["template"]["metadata"]["labels"]

    def guards(labels: dict[str, str]) -> bool:
        for p in policies:
            selector = p["spec"].get("podSelector", {}).get("matchLabels", {})
            if selector.items() <= labels.items() and "Ingress" in p["spec"].get("policyTypes", []):
                sources = [f for rule in p["spec"].get("ingress", []) for f in rule.get("from", [])]
                if sources and all("ipBlock" not in f for f in sources):
                    return True
        return False

    assert guards(master_labels), "mooncake-master: ingress open to the whole cluster"
    assert guards(daemon_labels), "hicache daemons: transfer-engine ports open to the whole cluster"


# --------------------------------------------------------------------------- systemd

UNIT_SCRIPT = ORCHESTRATE_COMMON + """
up_network(spec["ip"])
uid = gid = spec["uid"]
for top in ("/run", "/var/cache"):  # (nothing of the host's is written)
    sh("mount", "-t", "tmpfs", "tmpfs", top)
os.makedirs(spec["runtime_dir"]); os.chmod(spec["runtime_dir"], int(spec["runtime_mode"], 8))
os.chown(spec["runtime_dir"], uid, gid)
os.makedirs(spec["cache_dir"]); os.chmod(spec["cache_dir"], int(spec["cache_mode"], 8))
os.chown(spec["cache_dir"], uid, gid)
os.makedirs("/run/etc-hicache")  # ConfigurationDirectory (0750 root:hicache, file 0640)
os.chmod("/run/etc-hicache", 0o750); os.chown("/run/etc-hicache", 0, gid)
open(spec["config"], "w").write(spec["config_text"]); os.chmod(spec["config"], 0o640)
os.chown(spec["config"], 0, gid)
# ProtectHome=yes: /home and /root empty (but for this machine's interpreter, as /opt/hicache
# is in the unit's install).
expose_python(spec["python_home"])
if os.path.isdir("/home"):
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/home")
sh("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp")  # PrivateTmp
sh("mount", "-t", "tmpfs", "-o", "mode=1777,size=1g", "tmpfs", "/dev/shm")
# ProtectSystem=strict: all read-only but /dev, /proc, /sys and the unit's own directories.
for top, own in (("/run", spec["runtime_dir"]), ("/var/cache", spec["cache_dir"])):
    sh("mount", "--bind", own, own)
    sh("mount", "-o", "remount,bind,ro", top)
sh("mount", "-o", "remount,bind,ro", "/")
trace = "/tmp/strace.out"
# (strace as root: as the user it cannot resolve the venv's interpreter link here; it
# traces setpriv and sh too, whose few calls are the unit's own setup's)
argv = ["strace", "-f", "-qq", "-o", trace, *as_user(uid, gid, [], spec["exec_start"], umask=spec["umask"])]
env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent"}
proc = subprocess.Popen(argv, env=env,
                        stdout=open("/tmp/daemon.log", "w"), stderr=subprocess.STDOUT, cwd="/")
out = {"ready": wait_for(spec["socket"], proc, 90)}
if not out["ready"]:
    proc.kill()
    print(json.dumps({**out, "daemon_log_tail": open("/tmp/daemon.log").read()[-3000:]}))
    sys.exit(0)
time.sleep(0.5)
out["runtime_dir"] = stat_of(spec["runtime_dir"])
out["socket"] = stat_of(spec["socket"]) if os.path.exists(spec["socket"]) else None
out["engine"] = health(spec["engine_uid"], spec["engine_uid"], [gid], "unix://" + spec["socket"])
out["outsider"] = health(spec["outsider_uid"], spec["outsider_uid"], [], "unix://" + spec["socket"])
out["shm"] = {n: stat_of("/dev/shm/" + n)["mode"] for n in os.listdir("/dev/shm")}
out["cache_files"] = sorted(os.listdir(spec["cache_dir"]))
children = open("/proc/%d/task/%d/children" % (proc.pid, proc.pid)).read().split()
daemon = int(children[0])
started = time.monotonic()
os.kill(daemon, signal.SIGTERM)
try:
    out["strace_rc"] = proc.wait(spec["stop_timeout_s"])
except subprocess.TimeoutExpired:
    proc.kill(); out["strace_rc"] = "killed"
out["stop_s"] = time.monotonic() - started
names, families = set(), set()
import re
call = re.compile(r"^\\d+\\s+([a-z_0-9]+)\\(")
sock = re.compile(r"^\\d+\\s+socket(?:pair)?\\((AF_[A-Z0-9]+)")
for line in open(trace):
    m = call.match(line)
    if m:
        names.add(m.group(1))
    m = sock.match(line)
    if m:
        families.add(m.group(1))
out["syscalls"] = sorted(names)
out["families"] = sorted(families)
out["daemon_log_tail"] = open("/tmp/daemon.log").read()[-1500:]
print(json.dumps(out))
"""


def unit_service() -> dict[str, str]:
    return dict(deploy.unit()["Service"])


def systemd_exec_start(config_path: str) -> list[str]:
    """ExecStart as systemd runs it: `$HICACHE_ARGS` (unbraced) replaced by the env file's
    value split at whitespace, the binary the install symlinks taken from this venv."""
    active, _ = deploy.parse_env_file(deploy.ENV_FILE.read_text())
    words: list[str] = []
    for word in deploy.exec_start():
        if word == "$HICACHE_ARGS":
            words += active.get("HICACHE_ARGS", "").split()
        else:
            words.append(word)
    assert words[0] == "/usr/local/bin/hicache"
    words[0] = str(HICACHE)
    i = words.index("--config")
    words[i + 1] = config_path
    return words


@cache
def system_service_syscalls() -> frozenset[str]:
    """The unit's SystemCallFilter= groups, expanded by this machine's systemd-analyze."""

    def members(group: str) -> set[str]:
        out = run(["systemd-analyze", "syscall-filter", group]).stdout.splitlines()[1:]
        names: set[str] = set()
        for line in out:
            s = line.strip()
            if s and not s.startswith("#"):
                names |= members(s) if s.startswith("@") else {s}
        return names

    groups = unit_service()["SystemCallFilter"].split()
    return frozenset(n for g in groups for n in members(g))


def test_unit_emulated_under_strace(tmp_path: Path) -> None:
    """The unit's ExecStart (and HICACHE_ARGS) as its User/Group with its UMask, a
    read-only root with only RuntimeDirectory and CacheDirectory writable, a private
    /tmp; the reference hicache.yaml installed as /etc/hicache/hicache.yaml and edited
    to the file backend (the env file's storage.file.path). An engine in group hicache
    connects, another user is refused; shared memory is group-accessible; SIGTERM ends
    within TimeoutStopSec; every system call is in SystemCallFilter= and every socket
    family in RestrictAddressFamilies=."""
    need_namespaces()
    if shutil.which("strace") is None or shutil.which("systemd-analyze") is None:
        pytest.skip("strace / systemd-analyze not found")
    service = unit_service()
    exec_words = deploy.exec_start()
    listen = exec_words[exec_words.index("--listen") + 1]
    socket_path = listen.removeprefix("unix://")
    config_text = (ROOT / "hicache.yaml").read_text().replace("backend: none", "backend: file", 1)
    assert "backend: file" in config_text
    spec = {
        "hicache": str(HICACHE), "ip": POD_IP, "uid": 40001,
        "runtime_dir": f"/run/{service['RuntimeDirectory']}",
        "runtime_mode": service["RuntimeDirectoryMode"],
        "cache_dir": f"/var/cache/{service['CacheDirectory']}",
        "cache_mode": service["CacheDirectoryMode"],
        "config": "/run/etc-hicache/hicache.yaml", "config_text": config_text,
        "exec_start": systemd_exec_start("/run/etc-hicache/hicache.yaml"),
        "umask": service["UMask"], "socket": socket_path,
        "engine_uid": ENGINE_UID, "outsider_uid": OUTSIDER_UID,
        "stop_timeout_s": int(service["TimeoutStopSec"]),
        "python_home": PYTHON_HOME,
    }
    out = in_namespaces(UNIT_SCRIPT, spec, tmp_path, timeout=150)
    assert out["ready"], out["daemon_log_tail"]
    assert out["socket"] == {"mode": "0o660", "uid": 40001, "gid": 40001}, out
    engine = out["engine"]
    assert engine["rc"] == 0, out
    (backend,) = engine["report"]["backends"]
    assert backend["name"] == "file" and spec["cache_dir"] in backend["detail"], backend
    assert out["outsider"]["rc"] == 2, out
    assert out["shm"] and all(mode in ("0o660", "0o600") for mode in out["shm"].values()), out
    assert any(mode == "0o660" for mode in out["shm"].values())  # the L1 segments: group rw
    assert out["strace_rc"] == 0 and out["stop_s"] < spec["stop_timeout_s"], out
    assert {"execve", "bind", "listen", "accept4", "fallocate", "flock"} <= set(out["syscalls"])
    outside = sorted(set(out["syscalls"]) - system_service_syscalls())
    assert outside == [], f"blocked by SystemCallFilter= (EPERM): {outside}"
    allowed = set(service["RestrictAddressFamilies"].split())
    assert set(out["families"]) <= allowed, out["families"]
    assert "AF_UNIX" in out["families"] and "AF_INET" in out["families"]


def test_unit_keeps_gpu_and_rdma_devices_reachable() -> None:
    service = unit_service()
    assert service.get("PrivateDevices", "no") == "no"
    allows = [v for k, v in deploy.unit()["Service"] if k == "DeviceAllow"]
    closes = service.get("ProtectClock") == "yes" or allows or \
        service.get("DevicePolicy", "auto") != "auto"
    if closes:
        text = " ".join(allows)
        missing = [d for d in ("nvidia", "nvidia-uvm", "infiniband") if d not in text]
        assert not missing, f"device policy closed without {missing}"


def test_unit_does_not_restart_on_a_configuration_error(tmp_path: Path) -> None:
    bad = tmp_path / "hicache.yaml"
    bad.write_text("storage:\n  backend: nfs\n")
    words = systemd_exec_start(str(bad))
    words[words.index("--listen") + 1] = f"unix://{tmp_path}/h.sock"
    proc = run(words, env={**os.environ, "MOONCAKE_MASTER": ""})
    assert proc.returncode == 2, proc.stderr  # the CLI's exit code for a configuration error
    service = unit_service()
    assert service["Restart"] in ("on-failure", "always", "on-abnormal")
    prevented = service.get("RestartPreventExitStatus", "").split()
    assert str(proc.returncode) in prevented


# --------------------------------------------------------------------------- Dockerfile


def test_wheel_built_from_exactly_what_the_dockerfile_copies(tmp_path: Path) -> None:
    """`pip install .` in the image builds from the COPYed files only: the wheel holds
    every package and the embedded hicache.yaml as a regular file (the repository has a
    symlink), and `hicache config check` runs from it."""
    ctx = tmp_path / "src"
    ctx.mkdir()
    for args in deploy.dockerfile("COPY"):
        *sources, dest = args.split()
        for source in sources:
            target = ctx / dest / PurePosixPath(source).name if dest.endswith("/") else ctx / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / source, target, follow_symlinks=False)
    wheels = tmp_path / "wheels"
    proc = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--no-index", "-q", "-w", str(wheels), str(ctx)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = wheels.glob("hicache-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(site)
    for package in ("hicache/tiers/storage", "hicache/controller", "hicache/pb/hicache/v1",
                    "hicache/tree/components", "hicache/bench"):
        assert f"{package}/__init__.py" in names, package
    embedded = site / "hicache" / "hicache.yaml"
    assert not embedded.is_symlink() and embedded.read_text() == (ROOT / "hicache.yaml").read_text()
    check = run([sys.executable, "-c", "import sys; from hicache.cli import main; sys.exit(main())",
                 "config", "check"], env={**os.environ, "PYTHONPATH": str(site)}, cwd=str(tmp_path))
    assert check.returncode == 0, check.stderr
    assert "l1_bytes" in check.stdout


DOCKER_SCRIPT = ORCHESTRATE_COMMON + """
up_network(spec["ip"])
expose_python(spec["python_home"])
sh("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp")
sh("mount", "-t", "tmpfs", "-o", "mode=1777,size=64m", "tmpfs", "/dev/shm")  # docker run's default
env = {"PATH": os.environ["PATH"], **spec["image_env"]}
proc = subprocess.Popen(as_user(spec["uid"], spec["gid"], [], spec["entrypoint"], umask="0022"), env=env,
                        stdout=open("/tmp/daemon.log", "w"), stderr=subprocess.STDOUT, cwd="/")
out = {"ready": wait_for(spec["socket"], proc, 90)}
time.sleep(0.3)
out["health"] = health(spec["uid"], spec["gid"], [], "unix://" + spec["socket"])
out["rc"], out["stop_s"] = stop(proc, 30)
out["log"] = open("/tmp/daemon.log").read()[-1500:]
print(json.dumps(out))
"""


def test_image_entrypoint_runs_as_its_user_in_dockers_default_shm(tmp_path: Path) -> None:
    """`docker run hicache:0.1.0` with no arguments: ENTRYPOINT as USER 10001 with the
    image's ENV, the embedded configuration, Docker's default 64 MiB /dev/shm (the
    embedded L1 is exactly 64 MiB: it fits, with nothing to spare)."""
    need_namespaces()
    (user,) = deploy.dockerfile("USER")
    uid, _, gid = user.partition(":")
    (entrypoint,) = deploy.dockerfile("ENTRYPOINT")
    argv = yaml.safe_load(entrypoint)
    image_env = {}
    for line in deploy.dockerfile("ENV"):
        for word in shlex.split(line):
            key, _, value = word.partition("=")
            image_env[key] = value
    from hicache.config import load_config

    cfg = load_config(None, env={})
    spec = {"hicache": str(HICACHE), "ip": POD_IP, "uid": int(uid), "gid": int(gid),
            "entrypoint": [str(VENV_BIN / argv[0]), *argv[1:]], "image_env": image_env,
            "socket": cfg.server.listen.removeprefix("unix://"), "python_home": PYTHON_HOME}
    out = in_namespaces(DOCKER_SCRIPT, spec, tmp_path, timeout=120)
    assert out["ready"], out["log"]
    assert out["health"]["rc"] == 0, out
    assert out["rc"] == 0, out


def test_dockerfile_pins_torch_like_the_unit_install() -> None:
    pinned = re.search(r"torch==([0-9][0-9.]*)", deploy.UNIT.read_text())
    assert pinned, "the unit's install comment pins torch"
    args = dict(a.split("=", 1) for a in deploy.dockerfile("ARG") if "=" in a)
    runs = " ".join(deploy.dockerfile("RUN"))
    for name, value in args.items():  # (an ARG's default, as docker build substitutes it)
        runs = runs.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert f"torch=={pinned.group(1)}" in runs
