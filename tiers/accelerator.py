"""Whether this process can use CUDA, asking torch only where the answer could be yes.

Importing torch costs 1.5-3 s of CPU (measured here: 1.5 s of a daemon's 2.6 s start).
A CPU-only daemon needs it for no more than its large copies (`hicache.tiers.copy`), so
the question "is CUDA available?" is first put to the device nodes: without any of them
no CUDA (or ROCm) runtime can find a device, and torch is not imported to say so.
"""

from __future__ import annotations

import os
import sys

# What a process that can use a GPU sees: NVIDIA's control and device nodes (a container
# gets them from the NVIDIA runtime), WSL2's GPU node, ROCm's compute node (torch answers
# `cuda.is_available()` for ROCm too), or a loaded NVIDIA driver.
DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd",
                "/proc/driver/nvidia/version")


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch where no GPU node exists."""
    if sys.modules.get("torch") is None and not any(os.path.exists(p) for p in DEVICE_NODES):
        return False
    import torch

    return bool(torch.cuda.is_available())
