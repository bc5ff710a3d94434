"""``d2o``: D2O (Wan et al., 2024, "D2O: Dynamic Discriminative Operations for Efficient Generative
Inference of Large Language Models", arXiv 2406.13035).

Token level, the part implemented here: eviction as H2O's (a recent window plus the heavy hitters
by accumulated attention, the first ``sinks`` tokens always among them), except that an evicted
token is not simply dropped. Each evicted key finds its most similar kept key (cosine); if that
similarity reaches the layer's threshold, the evicted entry is merged into the kept one:
``k_c <- (e k_c + sum_j exp(u_j) k_j) / (e + sum_j exp(u_j))`` over the evicted ``j`` that chose
``c`` with similarity ``u_j`` (``e = exp(1)``: a key's similarity with itself), values alike. The
threshold is an exponential moving average of the mean best similarity of each eviction:
``tau <- alpha tau + (1 - alpha) mean(u)``, starting at the first eviction's mean. Merges happen
at prefill and at every eviction while decoding (the cache runs ``slack`` past the budget and is
gathered back to it, so one eviction merges ``slack`` tokens at once, where the paper evicts one
token per step; the threshold moves once per eviction).

Example, budget 4 (2 recent, 2 heavy hitters with ``sinks=1``) over keys ``t0 .. t5``: ``t0``
(sink) and the best of ``t1 .. t3`` by score, say ``t2``, are kept with ``t4 t5``; ``t1`` and
``t3`` are evicted; ``t3``'s key is closest to ``t2``'s with similarity 0.9 >= tau, so ``t2``
becomes ``(e t2 + e^0.9 t3) / (e + e^0.9)``; ``t1``'s best similarity is under tau and it is dropped.

Not implemented: the layer level (each layer's budget from the variance of its attention, deep
layers with dense attention keeping more), which needs a different length per layer where
:class:`~speculum.cache.PositionedKVCache` holds one length for all layers; nor the reference
code's exemption of the first two and the last layer from eviction, for the same reason. A merged
entry is read as one token (no attention bias for its cluster size), as in the paper.

Evictions, merges and threshold updates happen at the same commits whatever the steps' grouping of
tokens (the engine trims each tree at the next eviction,
:meth:`~speculum.kv.eviction.EvictionPolicy.draft_depth`, and committed draft tokens vote as in
H2O), so speculation under a lossy budget gives plain decoding's output under it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..options import parse_flag
from .h2o import H2OPolicy, H2OState
from .merging import cosine, left_out, put_back, take, weighted_merge


@dataclass
class D2OState(H2OState):
    """H2O's state plus each layer's merge threshold."""

    threshold: dict[int, float] = field(default_factory=dict)  # full-attention layer -> EMA of best similarities


class D2OPolicy(H2OPolicy):
    """H2O eviction whose evicted tokens merge into their most similar kept token.

    Options: ``recent_ratio`` (0.5: the reference code's equal split of recent tokens and heavy
    hitters), ``sinks`` (4: the first tokens always kept, as the reference code does), ``alpha``
    (0.5: weight of the previous threshold in its moving average), ``decode`` (1: also evict and
    merge while decoding; 0: at prefill only, the generated tokens appended).
    """

    name = "d2o"

    def __init__(self, budget="0.25", recent_ratio: float = 0.5, sinks: int = 4, alpha: float = 0.5, decode=True):
        super().__init__(budget, recent_ratio)
        self.sinks = int(sinks)
        self.alpha = float(alpha)
        if self.sinks < 0 or not 0 <= self.alpha <= 1:
            raise ValueError("d2o needs sinks >= 0 and alpha in [0, 1]")
        self.evicts_while_decoding = parse_flag(decode)

    def begin_prefill(self, cache, n):
        super().begin_prefill(cache, n)
        cache.state = D2OState(cache.state.budget, cache.state.kept)

    def _split(self, n: int, m: int, scores: torch.Tensor) -> torch.Tensor:
        if self.sinks:
            scores = scores.clone()
            scores[:, : self.sinks] = float("inf")
        return super()._split(n, m, scores)

    def merge_evicted(self, cache, layer, kv, idx):
        gone = left_out(idx, kv.shape[2])  # [H_kv, e]
        if gone.shape[1] == 0:
            return
        kept, lost = take(kv, idx), take(kv, gone)  # [2, H_kv, m, d], [2, H_kv, e, d]
        best, into = cosine(lost[0], kept[0]).max(-1)  # [H_kv, e]
        st = cache.state
        mean = float(best.mean())
        previous = st.threshold.get(layer)
        st.threshold[layer] = mean if previous is None else self.alpha * previous + (1 - self.alpha) * mean
        weight = best.exp() * (best >= st.threshold[layer])
        self_weight = torch.full(idx.shape, math.e, dtype=torch.float32, device=idx.device)
        put_back(kv, idx, weighted_merge(kept, self_weight, lost, weight, into))
