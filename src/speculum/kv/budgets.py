"""What the budget-allocation policies (PyramidKV, CAKE, AdaKV) share.

They keep the same total as SnapKV with a uniform budget ``m`` (``m`` entries in each of the ``F``
full-attention layers and each KV head), but split it unevenly: across layers (PyramidKV, CAKE) or
across the KV heads of a layer (AdaKV). Every full-attention layer keeps its observation window,
the last ``w = min(window, m)`` prompt tokens, and the split concerns the rest, ``F * (m - w)``
entries per head chosen among the ``n - w`` earlier ones. Selection happens once, at prefill;
tokens fed afterwards are appended to every layer and head, so the policies' decisions do not
depend on how decoding groups tokens into steps (tree verification sees what one-token steps see).

The cache is a :class:`~speculum.cache.RaggedKVCache`: each layer's buffer is allocated at the
size that layer keeps. Sliding-window layers (Gemma-3) keep their ``m`` most recent entries, as
under SnapKV, and take no part in the split. A budget that covers the prompt keeps everything.

:func:`apportion` turns real-valued shares into whole entries with the exact total, each under
the cap ``n - w``, what a capped layer cannot use going to the others in proportion.
Example: weights ``[3, 1]``, total 8, cap 5 -> ``[5, 3]`` (6 capped at 5, the spare 1 to the other).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..cache import RaggedKVCache
from .base import KVPolicy
from .eviction import recent
from .scoring import pool_scores, top_slots


@dataclass
class BudgetState:
    """One request's split (``full``: the full-attention layers, bottom to top)."""

    n: int  # prompt tokens
    kept: int  # the uniform budget m = min(budget, n), per layer and KV head
    window: int  # observation window kept in every full-attention layer: min(window, m)
    full: list[int] = field(default_factory=list)  # [F] full-attention layer indices
    # layer -> entries kept before its window, per KV head (Ada-KV: the heads' mean)
    budgets: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Entries per KV head before the windows, over all full-attention layers: ``F * (m - w)``."""
        return len(self.full) * (self.kept - self.window)

    @property
    def cap(self) -> int:
        """The most one layer or head can keep before its window: ``n - w``."""
        return self.n - self.window


def apportion(weights: Sequence[float], total: int, cap: int) -> list[int]:
    """Whole numbers proportional to ``weights`` (negative or non-finite: 0), each at most ``cap``, summing
    to ``min(total, cap * len(weights))``; what capped entries cannot take goes to the others in
    proportion (water-filling), and rounding goes by the largest remainders. All-zero weights split evenly."""
    k = len(weights)
    total = min(total, cap * k)
    w = [float(x) if math.isfinite(float(x)) and float(x) > 0 else 0.0 for x in weights]
    share = [0.0] * k
    free, left = set(range(k)), float(total)
    while free:
        mass = sum(w[i] for i in free)
        part = {i: (left * w[i] / mass if mass > 0 else left / len(free)) for i in free}
        over = [i for i in free if part[i] > cap]
        if not over:
            for i in free:
                share[i] = part[i]
            break
        for i in over:
            share[i] = float(cap)
            free.discard(i)
            left -= cap
    whole = [min(cap, math.floor(x + 1e-9)) for x in share]
    for i in sorted(range(k), key=lambda i: whole[i] - share[i]):  # largest remainder first
        if sum(whole) >= total:
            break
        if whole[i] < cap:
            whole[i] += 1
    return whole


def avg_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average-pool ``scores [H, n]`` along tokens (odd ``kernel``, same length; CAKE's smoothing)."""
    if kernel <= 1:
        return scores
    return F.avg_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2,
                        count_include_pad=True)[:, 0, : scores.shape[1]]


def with_window(scores: torch.Tensor, counts: int | Sequence[int], n: int) -> torch.Tensor | list[torch.Tensor]:
    """The slots to keep: each head's best ``counts`` of ``scores [H_kv, n - w]`` (the prompt before the
    window; one count for all heads or one per head) and the window ``n - w .. n-1``, increasing:
    ``[H_kv, k + w]``, or one row per head where counts differ."""
    heads, before = scores.shape
    window = torch.arange(before, n, device=scores.device)
    if isinstance(counts, int):
        chosen = top_slots(scores, counts) if counts else scores.new_empty((heads, 0), dtype=torch.long)
        return torch.cat([chosen, window.expand(heads, n - before)], dim=1)
    return [torch.cat([top_slots(scores[h:h + 1], c)[0] if c else window[:0], window]) for h, c in enumerate(counts)]


class BudgetPolicy(KVPolicy):
    """Base of the budget-allocation policies: prefill-time selection into a ragged cache.

    A subclass implements :meth:`store_selected` for full-attention layers when the prompt is longer
    than the budget; SnapKV's votes (``prefill_scores = "window"``) pooled over ``kernel`` tokens are
    :meth:`votes`.
    """

    prefill_scores = "window"

    def __init__(self, budget="0.25", window: int = 32, kernel: int = 15):
        super().__init__(budget)
        self.observation_window = int(window)
        self.kernel = int(kernel)
        if self.observation_window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window must be at least 1 and kernel a positive odd number, got {window}, {kernel}")

    def new_cache(self, layout, dtype, device, capacity: int) -> RaggedKVCache:
        return RaggedKVCache(layout, dtype, device, capacity)

    def new_state(self, cache: RaggedKVCache, n: int) -> BudgetState:
        m = min(self.budget.for_length(n), n) if n else 0
        full = [i for i in range(cache.layout.layers) if not cache.layout.is_sliding(i)]
        return BudgetState(n=n, kept=m, window=min(self.observation_window, m), full=full)

    def begin_prefill(self, cache: RaggedKVCache, n: int) -> None:
        cache.plan(n, max(cache.capacity_hint - n, 1))
        cache.state = self.new_state(cache, n)

    def store_prefill(self, cache: RaggedKVCache, layer: int, sliding: bool, kv: torch.Tensor,
                      scores: torch.Tensor | None) -> None:
        st = cache.state
        n = kv.shape[2]
        if st.kept >= n:
            cache.store_layer(layer, kv, None)
        elif sliding:
            cache.store_layer(layer, kv, recent(n, st.kept, kv.shape[1], kv.device))
        else:
            self.store_selected(cache, layer, kv, scores)

    def end_prefill(self, cache: RaggedKVCache, n: int) -> None:
        cache.end_prefill()

    def store_selected(self, cache: RaggedKVCache, layer: int, kv: torch.Tensor, scores: torch.Tensor) -> None:
        """Store a full-attention layer's ``kv [2, H_kv, n, d]`` keeping its share of the budget."""
        raise NotImplementedError

    def votes(self, scores: torch.Tensor, st: BudgetState) -> torch.Tensor:
        """SnapKV's votes ``[H_kv, n - w]`` for the prompt before the window: ``scores [H_kv, n]`` (the
        window's attention summed over its queries and each group's heads), max-pooled."""
        return pool_scores(scores[:, : st.cap], self.kernel)
