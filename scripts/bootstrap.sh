#!/usr/bin/env bash
# Sets everything up (Debian packages, .venv, the package) and then runs one thing:
#   scripts/bootstrap.sh serve [hicache serve args...]   the daemon on hicache.yaml's defaults
#   scripts/bootstrap.sh test  [pytest args...]          the whole test suite
#   scripts/bootstrap.sh setup                           only the set-up
# Idempotent: a second run only re-installs when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# (ldconfig is in /sbin, off a normal user's PATH on Debian.)
LDCONFIG=$(command -v ldconfig || echo /sbin/ldconfig)
have_lib() { "$LDCONFIG" -p 2>/dev/null | grep -q "$1"; }
need_debs=()
command -v redis-server >/dev/null 2>&1 || need_debs+=(redis-server)
# What the Mooncake wheel links against, even over TCP.
have_lib libibverbs.so.1 || need_debs+=(libibverbs1)
have_lib librdmacm.so.1 || need_debs+=(librdmacm1)
have_lib libnuma.so.1 || need_debs+=(libnuma1)
need_curl=0
have_lib libcurl.so.4 || need_curl=1
if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then need_debs+=(python3-venv); fi
if [ ${#need_debs[@]} -gt 0 ] || [ "$need_curl" = 1 ]; then
  as_root apt-get update -qq
  if [ "$need_curl" = 1 ]; then  # Debian 13 renamed it (64-bit time_t)
    if apt-cache show libcurl4t64 >/dev/null 2>&1; then need_debs+=(libcurl4t64); else need_debs+=(libcurl4); fi
  fi
  echo "bootstrap: installing Debian packages: ${need_debs[*]}" >&2
  # (sudo resets the environment: the variable goes through env.)
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}" >/dev/null
fi

stamp=$VENV/.hicache-installed
want=$(cat pyproject.toml | sha1sum | cut -d' ' -f1)
# A missing, broken (a dangling interpreter link) or other-Python .venv is made anew.
py_version='import sys; print(*sys.version_info[:2])'
if [ "$("$VENV/bin/python" -c "$py_version" 2>/dev/null)" != "$("$PY" -c "$py_version")" ]; then
  "$PY" -m venv --clear "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" "cupy-cuda12x" "mooncake-transfer-engine"
    extras="dev,plot"
  else
    # CPU-only machine: the CPU build of torch and the non-CUDA Mooncake wheel.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" \
      || "$VENV/bin/python" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    extras="dev,plot,mooncake"
  fi
  "$VENV/bin/python" -m pip install -q -e ".[$extras]"
  echo "$want" > "$stamp"
fi

cmd=${1:-setup}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) echo "bootstrap: ready (.venv)";;
  serve) exec "$VENV/bin/hicache" serve "$@";;
  test)
    export PATH="$VENV/bin:$PATH"
    set +e
    # mypy on the installed layout (hicache.tiers, hicache.controller): scripts/typecheck.py
    "$VENV/bin/ruff" check . && "$VENV/bin/python" scripts/typecheck.py --no-error-summary >/dev/null \
      || { echo "bootstrap: lint/type check failed" >&2; "$VENV/bin/python" scripts/typecheck.py | tail -20; exit 1; }
    # Three workers, a test file each (module-scoped daemons stay shared): most tests wait
    # on daemons, leases and subprocesses, so on 2 cores two workers kept ~1.4 busy (15.7
    # min for ~1,800 tests) and three ~1.8 (13.1 min for ~1,900).
    # HICACHE_TEST_WORKERS=0 runs in this process.
    workers=${HICACHE_TEST_WORKERS:-3}
    if [ "$workers" = 0 ]; then
      "$VENV/bin/python" -m pytest "$@"
    else
      "$VENV/bin/python" -m pytest -n "$workers" --dist loadfile "$@"
    fi
    rc=$?
    [ $rc -eq 5 ] && { echo "bootstrap: pytest collected no tests" >&2; exit 1; }
    exit $rc;;
  *) echo "usage: scripts/bootstrap.sh serve|test|setup [args...]" >&2; exit 2;;
esac
