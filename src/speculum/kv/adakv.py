"""``adakv``: Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference"). A layer's budget is split across its KV heads by where
the attention is: the layer's ``H_kv * B`` best-scored entries over all of its heads together
(``B = m - w`` per head before the observation window, SnapKV's votes as scores) say how many each
head gets, ``c_h``. A safeguard keeps every head at least a fraction ``alpha`` of the even share:
head ``h`` keeps ``alpha * B + (1 - alpha) * c_h`` entries (rounded, the layer's total kept), its
own best ones, and the window. Heads whose attention is concentrated give entries to heads whose
attention is spread out; the layer's total is a uniform budget's.

Example: 2 KV heads, ``B = 4``, ``alpha = 0.5``; head 0's votes are ``9 9 9 9 9 9``, head 1's
``5 5 1 1 1 1``. The 8 best of both are head 0's six nines and head 1's two fives, ``c = (6, 2)``,
so head 0 keeps ``0.5*4 + 0.5*6 = 5`` entries and head 1 ``0.5*4 + 0.5*2 = 3`` (its two fives and
one of its ones): 8 in all, as a uniform 4 each. With ``alpha = 1`` both keep 4 (SnapKV).

Heads of one layer are stored padded to the longest (:class:`~speculum.cache.RaggedKVCache`): the
padding is memory, counted in the cache's bytes, that the paper's flattened kernel does not hold.
"""

from __future__ import annotations

import torch

from .budgets import BudgetPolicy, apportion, with_window


def head_counts(votes: torch.Tensor, share: int, alpha: float) -> list[int]:
    """Each head's count from ``votes [H_kv, N]``: the heads' places among the ``H_kv * share`` best
    votes of all heads, ``c_h``, blended with the even share as ``alpha * share + (1 - alpha) * c_h``
    and rounded to sum ``H_kv * share`` (each at most ``N``)."""
    heads, width = votes.shape
    best = votes.flatten().topk(heads * share).indices // width
    c = torch.bincount(best, minlength=heads).tolist()
    return apportion([alpha * share + (1 - alpha) * ch for ch in c], heads * share, width)


class AdaKVPolicy(BudgetPolicy):
    """Per-head budgets from the layer's joint top scores with the ``alpha`` safeguard, on SnapKV's votes
    (``window`` observation queries, max-pooled over ``kernel`` tokens); every layer keeps ``m`` per head
    on average.

    ``alpha=0.2``, the paper's safeguard; ``kernel=15`` as speculum's SnapKV rather than the paper's 7
    (``adakv:kernel=7``): wider runs keep numbers that a tokenizer writes one digit per token whole.
    """

    name = "adakv"

    def __init__(self, budget="0.25", alpha: float = 0.2, window: int = 32, kernel: int = 15):
        super().__init__(budget, window, kernel)
        self.alpha = float(alpha)
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha is a fraction in [0, 1], got {alpha}")

    def __repr__(self) -> str:
        return f"adakv(budget={self.budget}, alpha={self.alpha:g})"

    def store_selected(self, cache, layer, kv, scores):
        st = cache.state
        votes = self.votes(scores, st)  # [H_kv, n - w]
        counts = head_counts(votes, st.kept - st.window, self.alpha)
        st.budgets[layer] = sum(counts) // len(counts)
        cache.store_layer(layer, kv, with_window(votes, counts, st.n))
