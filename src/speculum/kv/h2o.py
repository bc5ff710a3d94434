"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models"): half the budget keeps the most recent tokens,
the other half the tokens with the largest attention accumulated over all queries so far, per KV
head: every prompt token's at prefill, and every committed token's while decoding.

Under speculation a step verifies a tree whose rows are not all kept: the attention of a row is
added only once the row is committed (the root and the accepted path), so a drafted token votes
exactly when it becomes part of the text, as it would have under plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import Step, attention_probs, grouped, visibility
from .eviction import EvictionPolicy, EvictionState, recent
from .scoring import top_slots


@dataclass
class H2OState(EvictionState):
    """One request's budget and the step in flight (whose rows vote once committed)."""

    step: Step | None = None
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # full-attention layer -> q [n, H, d]


class H2OPolicy(EvictionPolicy):
    """Heavy hitters by accumulated attention + a recent window (``recent_ratio`` of the budget)."""

    name = "h2o"
    prefill_scores = "all"
    keeps_scores = True

    def __init__(self, budget="0.25", recent_ratio: float = 0.5):
        super().__init__(budget)
        self.recent_ratio = float(recent_ratio)

    def begin_prefill(self, cache, n):
        super().begin_prefill(cache, n)
        cache.state = H2OState(cache.state.budget, cache.state.kept)

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
        if not sliding and self.evicts_while_decoding:  # kept until commit, when the committed rows' attention is added
            cache.state.step = step
            cache.state.queries[layer] = q
        return cache.attend_all(layer, sliding, q, k, v, step)

    def before_commit(self, cache, keep):
        """Add the attention of the committed rows (``keep``, pending indices; None: all) to the scores,
        while the pending entries still sit in their forward's slots."""
        st, s = cache.state, cache.layout
        if st.step is None:
            return
        step, rows = st.step, keep if keep is not None else list(range(st.step.n))
        end = cache.length + step.n
        vis = visibility(cache.length, step.positions, step.new_mask, None)[0]  # [n, end] or None
        mask = None if vis is None else grouped(vis[rows], s.group, torch.float32)
        for layer, q in st.queries.items():
            cache.score[layer, :, :end] += self.votes(cache, layer, q[rows], end, mask, step.positions[rows])
        st.step, st.queries = None, {}

    def votes(self, cache, layer: int, q: torch.Tensor, end: int, mask: torch.Tensor | None,
              positions: torch.Tensor) -> torch.Tensor:
        """What committed rows ``q [r, H, d]`` at ``positions [r]`` add to the scores of ``layer``'s slots
        ``0 .. end-1`` (committed and pending) under the folded ``mask [g*r, end]`` (or None): their
        attention, summed over the rows and each KV group's query heads -> ``[H_kv, end]``."""
        s = cache.layout
        return attention_probs(q, cache.kv[layer, 0, :, :end], mask, s.scale, s.softcap).sum(1)  # of [H_kv, g*r, end]
