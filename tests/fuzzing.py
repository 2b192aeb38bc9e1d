"""The knobs every property-based fuzz of the suite reads, in one place.

    HICACHE_FUZZ_EXAMPLES=N   examples per property (each file has its own default)
    HICACHE_FUZZ_RANDOM=1     a new seed each run (the suite is derandomized: reproducible)
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz_examples(default: int) -> int:
    return int(os.environ.get("HICACHE_FUZZ_EXAMPLES", str(default)))


def fuzz_settings(default_examples: int, *also_suppress: HealthCheck) -> settings:
    """Derandomized unless HICACHE_FUZZ_RANDOM=1, no deadline (a loaded CI machine), no
    example database (the suite runs from clean clones), the slow-data checks off."""
    return settings(
        max_examples=fuzz_examples(default_examples),
        derandomize=os.environ.get("HICACHE_FUZZ_RANDOM") != "1",
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much, *also_suppress],
    )
