"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models"): half the budget keeps the most recent tokens,
the other half the tokens with the largest attention accumulated over all queries so far (the
prompt's at prefill, each committed token's while decoding), per KV head."""

from __future__ import annotations

import torch

from .eviction import EvictionPolicy, recent
from .scoring import attention_probs, top_slots


class H2OPolicy(EvictionPolicy):
    """Heavy hitters by accumulated attention + a recent window (``recent_ratio`` of the budget)."""

    name = "h2o"
    prefill_scores = "all"
    keeps_scores = True

    def __init__(self, budget="0.25", recent_ratio: float = 0.5):
        super().__init__(budget)
        self.recent_ratio = float(recent_ratio)

    def _split(self, n: int, m: int, scores: torch.Tensor) -> torch.Tensor:
        r = min(m, max(1, round(m * self.recent_ratio)))
        tail = recent(n, r, scores.shape[0], scores.device)
        if m == r:
            return tail
        return torch.cat([top_slots(scores[:, : n - r], m - r), tail], dim=1)

    def select_prefill(self, kv, scores, m):
        return self._split(kv.shape[2], m, scores)

    def select_decode(self, cache, layer, budget):
        return self._split(cache.length, budget, cache.score[layer, :, : cache.length])

    def attend(self, cache, layer, sliding, q, k, v, step):
        out = cache.attend_all(layer, sliding, q, k, v, step)
        if not sliding:  # the root (row 0) is always committed: its attention accumulates
            end = cache.length + 1
            probs = attention_probs(step.decoder, q[:1], cache.kv[layer, 0, :, :end], None)  # [H_kv, g, end]
            cache.score[layer, :, :end] += probs.sum(1)
        return out
