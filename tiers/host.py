"""L2 host pools: one page-aligned buffer (pinned when CUDA is present) for every member.

Sizing (`host_pages`, in `tiers/sizing.py`): token families get ``cfg.l2_pages(cfg.l1_pages)`` pages. MAMBA
gets ``ceil(mamba_slots x tiers.l2.ratio)`` slots, the same multiple of L1 that the token
pools get; with ``tiers.l2.size_gb`` it gets ``l2_pages`` slots, because `l2_pages` splits
the budget as if every member held that many entries, so the pools then fill exactly the
budget. `build_host_pools` refuses (``ConfigError``, both numbers in the message) when the
buffer exceeds MemAvailable minus ``tiers.l2.reserve_gb``.

Layouts (``tiers.l2.layout``):
- ``layer_first``: per member, per layer ``[num_pages, bytes_per_page_per_layer]`` (like L1);
- ``page_first``: per member, ``num_pages`` slots of `slot_bytes`; a slot is a
  `HEADER_BYTES` header area (written and verified in place by the L3 layer) followed by
  the payload ``layers x bytes_per_page_per_layer``, i.e. one L3 object, padded to 64 bytes.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hicache.config import OS_PAGE, HicacheConfig, MemberSpec
from hicache.errors import ConfigError, FailedPrecondition, InvalidArgument
from hicache.tiers.accelerator import cuda_available
from hicache.tiers.base import HEADER_BYTES, HostPools
from hicache.tiers.members import MemberTable
from hicache.tiers.pool import checked_ids
from hicache.tiers.prefault import Prefaulter
from hicache.tiers.sizing import (
    SLOT_ALIGN,
    check_host_fit,
    host_pages,
    round_up,
    slot_bytes,
)
from hicache.types import ComponentKind, HostLayout

if TYPE_CHECKING:  # torch is imported where a tensor is made: a CPU daemon may never need it
    import torch

__all__ = [
    "HEADER_BYTES",
    "SLOT_ALIGN",
    "HostBufferPools",
    "build_host_pools",
    "host_pages",
    "slot_bytes",
]

_OS_PAGE = OS_PAGE  # (the one rule: `HicacheConfig.l2_pages` sizes by it)


class HostBufferPools(MemberTable, HostPools):
    """L2 pools carved out of one anonymous mapping; pinned with CUDA when `pin` is set.

    Members' regions start on OS page boundaries, in config order. The constructor maps
    (and, if pinned, registers) the memory and nothing else; `close()` releases both.
    """

    def __init__(
        self,
        members: Sequence[MemberSpec],
        pages: Mapping[ComponentKind, int],
        layout: HostLayout,
        pin: bool = False,
    ) -> None:
        if layout is HostLayout.AUTO:
            raise InvalidArgument("l2: resolve layout 'auto' first (HicacheConfig.host_layout)")
        MemberTable.__init__(self, members, pages, "l2")
        self._layout = layout
        self._offsets: dict[str, int] = {}
        offset = 0
        for spec in self.members:
            self._offsets[spec.name] = offset
            offset = round_up(offset + self.region_bytes(spec), _OS_PAGE)
        self._size = max(offset, _OS_PAGE)
        try:
            self._map: mmap.mmap | None = mmap.mmap(
                -1, self._size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            )
        except OSError as e:
            if e.errno != errno.ENOMEM:
                raise
            raise ConfigError(
                f"tiers.l2: the host pools ({self._size} bytes) cannot be mapped ({e.strerror}): "
                "the address-space limit (ulimit -v) or the kernel's overcommit refuses them; "
                "lower tiers.l2.ratio / tiers.l2.size_gb or raise the limit"
            ) from None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer TLB misses on page-sized gathers/scatters (ignored where THP is off).
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self._buf: npt.NDArray[np.uint8] | None = np.frombuffer(self._map, dtype=np.uint8)
        self._address = int(self._buf.ctypes.data)
        self._pinned_chunks: list[tuple[int, int]] = []
        # Pinning touches every page; unpinned memory is populated in the background.
        self._prefault: Prefaulter | None = None if pin else Prefaulter(self._address, self._size, "l2")
        if pin:
            from hicache.tiers.cuda import register_host_memory

            try:
                self._pinned_chunks = register_host_memory(self._address, self._size)
            except BaseException:
                self.close()
                raise

    # Geometry --------------------------------------------------------------------

    def slot_bytes(self, spec: MemberSpec) -> int:
        return slot_bytes(spec, self._layout)

    def region_bytes(self, spec: MemberSpec) -> int:
        return self.num_pages(spec.component) * self.slot_bytes(spec)

    @property
    def layout(self) -> HostLayout:
        return self._layout

    @property
    def pinned(self) -> bool:
        return bool(self._pinned_chunks)

    def pinned_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self._pinned_chunks))

    @property
    def buffer_address(self) -> int:
        return self._address

    @property
    def buffer_size(self) -> int:
        return self._size

    @property
    def object_bytes(self) -> dict[str, int]:
        self._require_page_first()
        return {m.name: HEADER_BYTES + m.bytes_per_page for m in self.members}

    # Views -----------------------------------------------------------------------

    def layer(self, member: str, layer: int) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.layer_array(member, layer))

    def layer_array(self, member: str, layer: int) -> npt.NDArray[np.uint8]:
        spec = self.checked_layer(member, layer)
        n, row = self.num_pages(spec.component), spec.bytes_per_page_per_layer
        region = self._region(spec)
        if self._layout is HostLayout.LAYER_FIRST:
            rows = region[layer * n * row : (layer + 1) * n * row].reshape(n, row)
        else:
            start = HEADER_BYTES + layer * row
            rows = region.reshape(n, self.slot_bytes(spec))[:, start : start + row]
        return rows

    def buffer_view(self) -> npt.NDArray[np.uint8]:
        """The whole buffer as bytes (every member region, padding included)."""
        if self._buf is None:
            raise FailedPrecondition("l2: host pools are closed")
        return self._buf

    def object_view(self, member: str, page_id: int) -> npt.NDArray[np.uint8]:
        spec, slot = self._slot(member, page_id)
        return slot[: HEADER_BYTES + spec.bytes_per_page]

    def object_views(self, member: str, page_ids: npt.NDArray[np.int64]) -> list[npt.NDArray[np.uint8]]:
        self._require_page_first()
        spec = self.member(member)
        n = self.num_pages(spec.component)
        ids = checked_ids(page_ids, n, f"l2.{member}: page ids")
        slot = self.slot_bytes(spec)
        objects = self._region(spec)[: n * slot].reshape(n, slot)[:, : HEADER_BYTES + spec.bytes_per_page]
        return [objects[i] for i in ids.tolist()]

    def payload_view(self, member: str, page_id: int) -> npt.NDArray[np.uint8]:
        spec, slot = self._slot(member, page_id)
        return slot[HEADER_BYTES : HEADER_BYTES + spec.bytes_per_page]

    def object_address(self, member: str, page_id: int) -> int:
        spec, _ = self._slot(member, page_id)
        return self._address + self._offsets[member] + int(page_id) * self.slot_bytes(spec)

    def close(self, keep_memory: bool = False) -> None:
        if self._prefault is not None:
            self._prefault.stop()  # before the memory goes
            self._prefault = None
        if keep_memory:
            return
        if self._pinned_chunks:
            from hicache.tiers.cuda import unregister_host_memory

            unregister_host_memory(self._pinned_chunks)
            self._pinned_chunks = []
        self._buf = None
        if self._map is not None:
            # NOTE: a view handed out may still be alive; the mapping then goes with it.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    # Internals -------------------------------------------------------------------

    def _region(self, spec: MemberSpec) -> npt.NDArray[np.uint8]:
        if self._buf is None:
            raise FailedPrecondition("l2: host pools are closed")
        start = self._offsets[spec.name]
        return self._buf[start : start + self.region_bytes(spec)]

    def _slot(self, member: str, page_id: int) -> tuple[MemberSpec, npt.NDArray[np.uint8]]:
        self._require_page_first()
        spec = self.member(member)
        n = self.num_pages(spec.component)
        if not 0 <= int(page_id) < n:
            raise InvalidArgument(f"l2.{member}: page id {page_id} out of range [0, {n})")
        slot = self.slot_bytes(spec)
        start = int(page_id) * slot
        return spec, self._region(spec)[start : start + slot]

    def _require_page_first(self) -> None:
        if self._layout is not HostLayout.PAGE_FIRST:
            raise FailedPrecondition(
                f"l2: page objects need layout 'page_first' (pools are {self._layout.value!r})"
            )


def build_host_pools(
    cfg: HicacheConfig, pin: bool | None = None, available_bytes: int | None = None
) -> HostBufferPools:
    """The L2 pools of this node, sized and laid out by `cfg`.

    `pin` defaults to "CUDA is available"; `available_bytes` defaults to MemAvailable.
    Raises `ConfigError` naming the needed and the allowed byte counts when the pools do
    not fit in ``available - tiers.l2.reserve_gb``.
    """
    check_host_fit(cfg, available_bytes)
    if pin is None:
        pin = cuda_available()
    return HostBufferPools(cfg.model.members, host_pages(cfg), cfg.host_layout, pin=pin)
