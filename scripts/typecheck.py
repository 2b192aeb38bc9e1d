"""Type-check the `hicache` distribution as it installs: `tiers/` as `hicache.tiers`,
`controller/` as `hicache.controller`.

mypy does not follow the editable install's import hook, so run from the repository root
it sees `hicache.tiers.*` and `hicache.controller.*` as missing (Any, with
`ignore_missing_imports`) and checks nothing across those packages. This builds the
installed layout out of symlinks in a temporary directory and checks `-p hicache` there,
with the repository's configuration. Exit status: mypy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"tiers": "tiers", "controller": "controller"}  # hicache.<name> -> top-level folder


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="hicache-typecheck-") as tmp:
        pkg = Path(tmp) / "hicache"
        pkg.mkdir()
        for entry in (ROOT / "hicache").iterdir():
            if entry.name != "__pycache__":
                os.symlink(entry, pkg / entry.name)
        for name, folder in MAPPED.items():
            os.symlink(ROOT / folder, pkg / name)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(ROOT / ".mypy_cache" / "installed"), "-p", "hicache",
               *sys.argv[1:]]
        return subprocess.call(cmd, cwd=tmp)


if __name__ == "__main__":
    raise SystemExit(main())
