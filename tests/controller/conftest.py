"""The controller factory every controller test uses: each controller gets a unique
instance name (its shared-memory segment), and after the test its page ownership is
audited (`check_integrity`) before it closes."""

from __future__ import annotations

import itertools
import time

import pytest
from engine_sim import tiny_config

from hicache.controller.controller import build_controller

_instances = itertools.count()


@pytest.fixture
def make(tmp_path):
    built = []

    def factory(**kw):
        cfg = tiny_config(tmp_path, **kw)
        ctl = build_controller(cfg, f"t{next(_instances)}x{int(time.time() * 1000) % 100000}")
        built.append(ctl)
        return ctl

    yield factory
    try:
        for ctl in built:
            ctl.check_integrity()
    finally:  # a failed audit must not leave shared-memory segments behind
        for ctl in built:
            ctl.close()
