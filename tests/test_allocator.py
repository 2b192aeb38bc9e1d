"""hicache.allocator: after `tune()`, freeing and reallocating large arrays stops faulting
their pages in again (run in a child process: the settings are process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHURN = """
import json, resource, sys
import numpy as np
from hicache import allocator

def faults_per_round():
    # Two live 1 MiB arrays a round, freed at its end (a match's FULL and SWA ids).
    parts = [np.arange(8192, dtype=np.int64) + i for i in range(16)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):
        a = np.concatenate(parts)
        b = np.concatenate(parts[::-1])
        del a, b
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 200

default = faults_per_round()
tuned = allocator.tune()
faults_per_round()  # the heap grows to hold them once
print(json.dumps({"default": default, "tuned": tuned, "after": faults_per_round()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_allocator_keeps_large_arrays_mapped() -> None:
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, check=True, timeout=60)
    figures = json.loads(out.stdout)
    if not figures["tuned"]:
        pytest.skip("the C library has no mallopt (not glibc)")
    if figures["default"] <= 50:
        pytest.skip(f"this C library keeps such arrays mapped already: {figures}")
    # glibc's defaults: each round maps and faults in ~500 pages again; tuned: none.
    assert figures["after"] < 1, figures
