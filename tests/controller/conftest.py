"""The controller factory every controller test uses: each controller gets a unique
instance name (its shared-memory segment), and after the test its page ownership is
audited (`check_integrity`) before it closes (`engine_sim.built_controllers`)."""

from __future__ import annotations

import pytest
from engine_sim import built_controllers


@pytest.fixture
def make(tmp_path):
    with built_controllers(tmp_path) as factory:
        yield factory
