"""`hicache bench tree`: the radix tree's cost on a multi-turn workload.

48 conversations share a 2,048-token system prompt; each turn adds 1,024 random tokens;
20 turns, round-robin over conversations. Per request: match (with a lock) then insert of
the whole prompt (the lock's prefix is reused, the new pages are committed). Token bytes
and page ids are prepared outside the timers. Eviction runs when the L1 budget is short.
FULL alone and FULL+SWA+MAMBA step through the workload side by side, one request each in
turn (`run_paired`), so that their ratio is measured in one run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
import tracemalloc
from collections.abc import Generator, Mapping
from dataclasses import asdict, dataclass

import numpy as np

from hicache import allocator
from hicache.argtypes import output_file, positive_int
from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, Tier

K = ComponentKind


@dataclass
class Figures:
    page_size: int
    components: str
    budget_tokens: int
    requests: int
    match_us_mean: float
    match_us_p50: float
    match_us_p99: float
    insert_us_mean: float
    insert_us_p50: float
    insert_us_p99: float
    evict_us_mean: float
    evict_us_p50: float
    evict_us_p99: float
    evictions: int
    metadata_bytes_per_page: float
    token_key_bytes_per_page: float
    reused_tokens_mean: float  # device tokens a request resumed from (same work to compare)


class _Pool:
    """The test engine's page allocator (outside the timers)."""

    def __init__(self, pages: int) -> None:
        self.size = pages
        self.free = list(range(pages - 1, -1, -1))

    def take(self, n: int) -> np.ndarray:
        out = self.free[-n:] if n else []
        del self.free[len(self.free) - n :]
        return np.array(out[::-1], dtype=np.int64)

    def give(self, ids: np.ndarray) -> None:
        self.free.extend(ids.tolist())


def _components(spec: str, window: int) -> dict[ComponentKind, int]:
    kinds = {K.FULL: 0}
    if "swa" in spec:
        kinds[K.SWA] = window
    if "mamba" in spec:
        kinds[K.MAMBA] = 0
    return kinds


def _stats(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return 0.0, 0.0, 0.0
    a = np.array(xs) * 1e6
    return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run_workload(page_size: int, spec: str, budget_tokens: int, **workload: int) -> Figures:
    """One configuration's run, alone (`workload`: `_workload`'s keyword parameters)."""
    return _drive([_workload(page_size, spec, budget_tokens, **workload)])[0]


def run_paired(page_size: int, budget_tokens: int, conversations: int = 48, turns: int = 20,
               specs: tuple[str, str] = ("full", "full,swa,mamba")) -> tuple[Figures, Figures]:
    """Two configurations on the same workload (same seed), request by request in turn:
    a burst of load from elsewhere on the machine lands on both alike, so their ratio
    is measured in one run rather than across two stretches of time."""
    first, second = _drive([_workload(page_size, spec, budget_tokens, conversations, turns)
                            for spec in specs])
    return first, second


def _drive(runs: list[Generator[None, None, Figures]]) -> list[Figures]:
    """Step each workload one request at a time, in turn, until all have finished
    (the garbage collector off throughout, as it is in a timed section)."""
    out: dict[int, Figures] = {}
    gc.collect()
    gc.disable()
    try:
        while len(out) < len(runs):
            for i, steps in enumerate(runs):
                if i in out:
                    continue
                try:
                    next(steps)
                except StopIteration as done:
                    out[i] = done.value
    finally:
        gc.enable()
    return [out[i] for i in range(len(runs))]


def _workload(
    page_size: int,
    spec: str,
    budget_tokens: int,
    conversations: int = 48,
    turns: int = 20,
    system_tokens: int = 2048,
    turn_tokens: int = 1024,
    window: int = 4096,
    seed: int = 0,
) -> Generator[None, None, Figures]:
    """The workload, yielding after each request; returns the figures."""
    rng = np.random.default_rng(seed)
    kinds = _components(spec, window)
    tree = HiRadixTree(page_size, kinds)
    pages = budget_tokens // page_size
    full, swa = _Pool(pages), _Pool(pages)
    mamba = _Pool(max(64, pages // max(1, turn_tokens // page_size)))
    window_pages = -(-window // page_size)
    pools = {K.FULL: full, K.SWA: swa, K.MAMBA: mamba}

    def give_back(freed: Mapping[ComponentKind, np.ndarray]) -> None:
        for kind, ids in freed.items():
            pools[kind].give(ids)

    system = rng.integers(0, 150_000, system_tokens, dtype=np.uint32)
    histories = [system.copy() for _ in range(conversations)]
    match_t: list[float] = []
    reused = 0
    insert_t: list[float] = []
    evict_t: list[float] = []
    evictions = 0
    clock = time.perf_counter
    for _turn in range(turns):
        for c in range(conversations):
            turn = rng.integers(0, 150_000, turn_tokens, dtype=np.uint32)
            histories[c] = np.concatenate([histories[c], turn])
            prompt = histories[c].astype("<u4").tobytes()
            t0 = clock()
            m = tree.match("", prompt, lock=True)
            match_t.append(clock() - t0)
            reused += m.device_tokens
            total = (len(prompt) // 4) // page_size
            start = m.device_tokens // page_size
            need = total - start
            # The tree knows more of the prompt than the hybrid boundary lets the
            # engine reuse (a shared prefix whose MAMBA state was never kept): the
            # engine recomputes from the boundary and, passing the junction, keeps
            # the MAMBA state and SWA window there, as vLLM's fine-grained Mamba
            # prefix cache does, so the next request resumes at the junction.
            junction = m.matched_tokens // page_size if K.MAMBA in kinds else start
            cuts = [start, junction, total] if start < junction < total else [start, total]
            # Like an SWA engine, the simulated one keeps SWA KV only for the window
            # before each checkpoint: pages before it were freed during prefill and
            # are passed as -1 (the tree records tombstones there).
            keeps = [min(b - a, window_pages) for a, b in itertools.pairwise(cuts)]
            wants = {K.FULL: need, K.SWA: sum(keeps), K.MAMBA: len(keeps)}
            for pool, kind in ((full, K.FULL), (swa, K.SWA), (mamba, K.MAMBA)):
                want = wants[kind]
                # A component's own eviction first (SWA: out-of-window tombstones,
                # MAMBA: checkpoints), then whole leaves, which free every slot.
                for victim_kind in (kind, K.FULL):
                    if kind not in kinds or len(pool.free) >= want:
                        break
                    t0 = clock()
                    ev = tree.evict(Tier.DEVICE, victim_kind, want - len(pool.free))
                    evict_t.append(clock() - t0)
                    evictions += 1
                    give_back(ev.freed)
            full_ids = full.take(need)
            spent = 0.0
            for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                new = {K.FULL: full_ids[a - start : b - start]}
                if K.SWA in kinds:
                    ids = np.full(b - a, -1, dtype=np.int64)
                    ids[b - a - keeps[i] :] = swa.take(keeps[i])
                    new[K.SWA] = ids
                slot = int(mamba.take(1)[0]) if K.MAMBA in kinds else None
                last = b == total
                t0 = clock()
                r = tree.insert("", prompt if last else prompt[: b * page_size * 4], new,
                                lock=m.lock, keep_lock=not last, mamba_slot=slot)
                spent += clock() - t0
                give_back(r.released)
            insert_t.append(spent)
            yield
    tree.check_integrity()
    for kind in kinds:  # every page id is either free or held by the tree: nothing leaked
        held = tree.resident_pages(Tier.DEVICE, kind)
        if len(pools[kind].free) + held != pools[kind].size:
            raise AssertionError(f"{kind.value} pool: {len(pools[kind].free)} free + {held} held != {pools[kind].size}")
    meta, keys = _metadata_bytes(tree)
    cached = tree.resident_pages(Tier.DEVICE, K.FULL)
    return Figures(
        page_size, spec, budget_tokens, len(match_t),
        *_stats(match_t), *_stats(insert_t), *_stats(evict_t), evictions,
        meta / max(1, cached), keys / max(1, cached), reused / max(1, len(match_t)),
    )


def _metadata_bytes(tree: HiRadixTree) -> tuple[int, int]:
    """Bytes the tree allocates per cached page, split into token keys and the rest,
    measured by rebuilding the same tree shape under tracemalloc."""
    import sys

    from hicache.tree.node import Node

    total = keys = 0
    seen: set[int] = set()
    stack = [r for r in tree._roots.values()]
    while stack:
        node: Node = stack.pop()
        stack.extend(node.children.values())
        keys += sys.getsizeof(node.key)
        total += sys.getsizeof(node) + sys.getsizeof(node.children)
        for lst in (node.res, node.mask, node.lock, node.sref, node.nres):
            total += sys.getsizeof(lst)
        for arr in node.res:
            if arr is not None:
                total += sys.getsizeof(arr)  # (with its data when it owns it)
                base = arr.base
                if base is not None and id(base) not in seen:  # a view: its base once
                    seen.add(id(base))
                    total += base.nbytes
        if node.hashes is not None:
            total += sys.getsizeof(node.hashes)
    return total, keys


def prompt_growth(page_size: int, spec: str, max_tokens: int = 131072, seed: int = 1) -> list[tuple[int, float]]:
    """Match cost against prompt length, one conversation grown 1K at a time."""
    rng = np.random.default_rng(seed)
    tree = HiRadixTree(page_size, _components(spec, 4096))
    tokens = rng.integers(0, 150_000, max_tokens, dtype=np.uint32).astype("<u4")
    pool = _Pool(max_tokens // page_size + 8)
    out = []
    length = 1024
    while length <= max_tokens:
        prompt = tokens[:length].tobytes()
        m = tree.match("", prompt, lock=True)
        need = length // page_size - m.device_tokens // page_size
        new = {K.FULL: pool.take(need)}
        if "swa" in spec:
            new[K.SWA] = np.arange(need)
        tree.insert("", prompt, new, lock=m.lock, mamba_slot=length if "mamba" in spec else None)
        if length & (length - 1) == 0:
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                tree.match("", prompt)
                times.append(time.perf_counter() - t0)
            out.append((length, float(np.median(times)) * 1e6))
        length += 1024
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=positive_int, default=48)
    p.add_argument("--turns", type=positive_int, default=20)
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="side-by-side runs of FULL and the hybrid per page size and budget")
    p.add_argument("--quick", action="store_true", help="fewer configurations (CI smoke run)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="also write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    tracemalloc.stop()
    allocator.tune()  # as `hicache serve` runs the tree
    pairs = [(64, 2_000_000), (64, 262_144), (1, 2_000_000), (1, 262_144)]
    if args.quick:
        pairs = pairs[:1]
    hdr = (f"{'page':>4} {'components':<15} {'budget':>9} {'match mean/p50/p99 us':>24} "
           f"{'insert mean/p50/p99 us':>24} {'evict mean/p99 us':>18} {'meta B/page':>11} {'keys B/page':>11} "
           f"{'reused tok':>10}")
    print(hdr)
    # FULL and the hybrid run side by side, request by request in turn (`run_paired`), so
    # load from elsewhere on the machine weighs on both alike. Per pair of configurations,
    # the table shows the round with the lowest FULL + hybrid match + insert mean (noise
    # only ever adds time), and each ratio is the median over the rounds of that round's
    # hybrid / FULL.
    rows: list[Figures] = []
    ratios: dict[str, float] = {}
    per_round: dict[str, list[float]] = {}
    for page, budget in pairs:
        runs = [run_paired(page, budget, args.conversations, args.turns) for _ in range(args.rounds)]
        full, hybrid = min(runs, key=lambda r: sum(f.match_us_mean + f.insert_us_mean for f in r))
        rows += [full, hybrid]
        for f in (full, hybrid):
            print(f"{f.page_size:>4} {f.components:<15} {f.budget_tokens:>9} "
                  f"{f.match_us_mean:8.1f}/{f.match_us_p50:6.1f}/{f.match_us_p99:7.1f} "
                  f"{f.insert_us_mean:8.1f}/{f.insert_us_p50:6.1f}/{f.insert_us_p99:7.1f} "
                  f"{f.evict_us_mean:8.1f}/{f.evict_us_p99:8.1f} "
                  f"{f.metadata_bytes_per_page:11.1f} {f.token_key_bytes_per_page:11.1f} "
                  f"{f.reused_tokens_mean:10.0f}")
        for op in ("match", "insert"):
            key = f"hybrid_vs_full_{op}_p{page}_{budget}"
            per_round[key] = [getattr(h, f"{op}_us_mean") / getattr(f, f"{op}_us_mean") for f, h in runs]
            ratios[key] = float(np.median(per_round[key]))
    print(f"\nFULL+SWA+MAMBA / FULL alone (mean per request, side by side; median of {args.rounds} rounds, "
          "and the rounds' range):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x  ({min(per_round[k]):.2f}-{max(per_round[k]):.2f})")
    growth = prompt_growth(64, "full") if not args.quick else []
    if growth:
        print("\nmatch cost vs prompt length (page 64, FULL, median us):")
        print("  " + "  ".join(f"{n // 1024}K:{us:.1f}" for n, us in growth))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"configs": [asdict(r) for r in rows], "ratios": ratios,
                       "ratio_rounds": per_round, "match_vs_prompt_tokens": growth}, fh, indent=2)
    return 0
