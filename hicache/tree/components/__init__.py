"""Component strategies. `build_components` maps the configured kinds to strategy objects."""

from __future__ import annotations

from collections.abc import Mapping

from hicache.tree.components.base import Component
from hicache.tree.components.full import FULL_INDEX, FullComponent
from hicache.tree.components.mamba import MambaComponent
from hicache.tree.components.swa import SwaComponent
from hicache.types import ComponentKind

__all__ = [
    "FULL_INDEX",
    "Component",
    "FullComponent",
    "MambaComponent",
    "SwaComponent",
    "build_components",
]


def build_components(
    kinds: Mapping[ComponentKind, int], page_size: int
) -> list[Component]:
    """`kinds` maps each active kind to its parameter (SWA: window tokens; others: unused).
    FULL comes first: it is the backbone every other slot hangs on."""
    if ComponentKind.FULL not in kinds:
        raise ValueError("FULL is required")
    factories = {
        ComponentKind.FULL: lambda i, _p: FullComponent(i, page_size),
        ComponentKind.SWA: lambda i, p: SwaComponent(i, page_size, p),
        ComponentKind.MAMBA: lambda i, _p: MambaComponent(i, page_size),
    }
    ordered = [k for k in ComponentKind if k in kinds]
    return [factories[k](i, kinds[k]) for i, k in enumerate(ordered)]
