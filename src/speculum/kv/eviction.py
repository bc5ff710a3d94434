"""What the eviction policies (StreamingLLM, H2O, SnapKV, Keyformer, D2O, Chelsea) share.

After prefill every layer and KV head keeps ``m = min(budget, n)`` of the ``n`` prompt entries;
the cache is allocated for ``m`` plus what decoding adds, so the evicted entries never occupy
memory beyond the one layer being prefilled. Sliding-window layers (Gemma-3) keep their most
recent entries, which is all they ever attend to. Policies that also evict while decoding let
the cache grow ``slack`` entries past the budget and then gather it back to the budget in one
pass, so the cost of a gather is spread over many steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PositionedKVCache
from .base import KVPolicy


@dataclass
class EvictionState:
    """One request's eviction budget."""

    budget: int  # entries kept per layer and KV head after an eviction
    kept: int  # prompt entries kept at prefill: min(budget, prompt length)


def recent(n: int, m: int, heads: int, device) -> torch.Tensor:
    """Slots of the ``m`` most recent of ``n`` entries, ``[heads, m]``."""
    return torch.arange(n - m, n, device=device).expand(heads, m)


class EvictionPolicy(KVPolicy):
    """Base of the eviction policies: subclasses choose the slots to keep."""

    keeps_scores = False  # per-slot accumulated attention in the cache (H2O)
    evicts_while_decoding = True

    def new_cache(self, layout, dtype, device, capacity: int) -> PositionedKVCache:
        return PositionedKVCache(layout, dtype, device, capacity, with_scores=self.keeps_scores,
                                 rolling=self.rolling)

    @staticmethod
    def slack(budget: int) -> int:
        return max(16, budget // 16)

    def begin_prefill(self, cache: PositionedKVCache, n: int) -> None:
        budget = self.budget.for_length(n)
        cache.state = EvictionState(budget=budget, kept=min(budget, n))
        growth = max(cache.capacity_hint - n, 1)
        if self.evicts_while_decoding:
            growth = min(growth, self.slack(budget) + 128)
        cache.reserve(cache.state.kept + growth)

    def store_prefill(self, cache: PositionedKVCache, layer: int, sliding: bool, kv: torch.Tensor,
                      scores: torch.Tensor | None) -> None:
        n = kv.shape[2]
        m = cache.state.kept
        idx = None
        if m < n and sliding:
            idx = recent(n, m, kv.shape[1], kv.device)
        elif m < n:
            idx = self.select_prefill(kv, scores, m)
            self.merge_evicted(cache, layer, kv, idx)
        cache.store_layer(layer, kv, idx)
        if cache.score is not None and scores is not None:
            cache.score[layer, :, :m] = scores if idx is None else scores.gather(1, idx)

    def end_prefill(self, cache: PositionedKVCache, n: int) -> None:
        m = cache.state.kept
        cache.length, cache.evicted = m, n - m
        cache.peak_bytes = cache.nbytes()

    def select_prefill(self, kv: torch.Tensor, scores: torch.Tensor | None, m: int) -> torch.Tensor:
        """Slots ``[H_kv, m]`` (increasing) to keep of a full-attention layer's ``kv [2, H_kv, n, d]``."""
        raise NotImplementedError

    def select_decode(self, cache: PositionedKVCache, layer: int, budget: int) -> torch.Tensor:
        """Slots ``[H_kv, budget]`` (increasing) to keep of a full-attention layer's committed slots."""
        raise NotImplementedError

    def draft_depth(self, cache: PositionedKVCache) -> int | None:
        """Plain decoding evicts after the commit that takes the cache past ``budget + slack``: a step
        may commit up to that one, no further."""
        if not self.evicts_while_decoding:
            return None
        budget = cache.state.budget
        return max(0, budget + self.slack(budget) - cache.length)

    def merge_evicted(self, cache: PositionedKVCache, layer: int, kv: torch.Tensor, idx: torch.Tensor) -> None:
        """Before the entries of a full-attention layer's ``kv [2, H_kv, L, d]`` outside slots ``idx
        [H_kv, m]`` are dropped (at prefill, or from the cache while decoding): fold them into kept
        slots, in place (D2O). By default they are just dropped."""

    def after_commit(self, cache: PositionedKVCache) -> None:
        budget = cache.state.budget
        if not self.evicts_while_decoding or cache.length <= budget + self.slack(budget):
            return
        heads = cache.layout.kv_heads
        idx = torch.stack([recent(cache.length, budget, heads, cache.device) if cache.layout.is_sliding(i)
                           else self.select_decode(cache, i, budget)
                           for i in range(cache.layout.layers)])
        for i in range(cache.layout.layers):
            if not cache.layout.is_sliding(i):
                self.merge_evicted(cache, i, cache.kv[i, :, :, : cache.length], idx[i])
        cache.keep_slots(idx)
