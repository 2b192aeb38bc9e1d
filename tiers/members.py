"""`MemberTable`: members, families, page counts and allocators shared by L1 and L2 pools."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.config import MemberSpec
from hicache.errors import InvalidArgument
from hicache.tiers.pool import PageAllocator
from hicache.types import ComponentKind


class MemberTable:
    """The bookkeeping half of a pools object: which members exist, how many pages each
    family has, and the one `PageAllocator` per family (sidecars share their anchor's)."""

    def __init__(
        self, members: Sequence[MemberSpec], pages: Mapping[ComponentKind, int], tier: str
    ) -> None:
        if not members:
            raise InvalidArgument(f"{tier}: no member pools configured")
        missing = sorted({m.component.value for m in members} - {k.value for k in pages})
        if missing:
            raise InvalidArgument(f"{tier}: no page count for components {missing}")
        self._tier = tier
        self._members = tuple(members)
        self._by_name = {m.name: m for m in self._members}
        self._pages = {m.component: pages[m.component] for m in self._members}
        self._allocators = {
            kind: PageAllocator(n, f"{tier}.{kind.value}") for kind, n in self._pages.items()
        }

    @property
    def members(self) -> tuple[MemberSpec, ...]:
        return self._members

    def member(self, name: str) -> MemberSpec:
        spec = self._by_name.get(name)
        if spec is None:
            raise InvalidArgument(
                f"{self._tier}: unknown member {name!r}; known: {sorted(self._by_name)}"
            )
        return spec

    def family(self, kind: ComponentKind) -> tuple[MemberSpec, ...]:
        if kind not in self._pages:
            raise InvalidArgument(
                f"{self._tier}: no pools for component {kind.value!r}; "
                f"known: {sorted(k.value for k in self._pages)}"
            )
        return tuple(m for m in self._members if m.component is kind)

    def num_pages(self, kind: ComponentKind) -> int:
        self.family(kind)
        return self._pages[kind]

    def allocator(self, kind: ComponentKind) -> PageAllocator:
        self.family(kind)
        return self._allocators[kind]

    def check_integrity(self) -> None:
        for alloc in self._allocators.values():
            alloc.check_integrity()

    def checked_layer(self, member: str, layer: int) -> MemberSpec:
        spec = self.member(member)
        if not 0 <= layer < spec.layers:
            raise InvalidArgument(
                f"{self._tier}.{member}: layer {layer} out of range [0, {spec.layers})"
            )
        return spec
