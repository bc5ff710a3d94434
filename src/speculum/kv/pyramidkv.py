"""``pyramidkv``: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling"). Attention spreads over the whole context in the lower layers and
narrows to a few tokens in the upper ones, so lower layers keep more entries and upper ones fewer:
each full-attention layer's share falls linearly with depth, from ``2a - a/beta`` at the bottom to
``a/beta`` at the top, where ``a = m - w`` is a uniform budget ``m`` less the observation window
``w``; the shares sum to what the uniform budget keeps. Within a layer SnapKV's rule picks the
entries (the window's pooled attention votes, per KV head) and the window itself is kept too.

Where the bottom share would pass the ``n - w`` tokens before the window, it is set to that and the
top one raised to keep the total (the ramp flattens, as in the paper's code).

Example: 4 full-attention layers, budget ``m = 40``, window ``w = 8`` (``a = 32``), ``beta = 4``, a
long prompt: the shares before the window are 56, 40, 24, 8 (128 = 4 x 32), and each layer keeps
its share and its 8 window tokens: 64, 48, 32, 16 entries per KV head.
"""

from __future__ import annotations

from .budgets import BudgetPolicy, BudgetState, apportion, with_window


def pyramid(layers: int, share: int, cap: int, beta: float) -> list[int]:
    """Per-layer shares, bottom to top, falling linearly from ``2*share - share/beta`` to ``share/beta``
    (the bottom at most ``cap``, the top raised to keep the total), in whole entries summing to
    ``layers * share`` (at most ``layers * cap``)."""
    if layers == 1:
        return apportion([1.0], share, cap)
    low = share / beta
    high = 2 * share - low
    if high > cap:
        high, low = cap, 2 * share - cap
    ramp = [high - (high - low) * i / (layers - 1) for i in range(layers)]
    return apportion(ramp, layers * share, cap)


class PyramidKVPolicy(BudgetPolicy):
    """Pyramid-shaped per-layer budgets (``beta``: the top layer keeps ``1/beta`` of the mean share)
    with SnapKV's selection inside each layer (``window`` observation queries, votes max-pooled over
    ``kernel`` tokens).

    ``kernel=15`` as speculum's SnapKV rather than the paper's pooling (``pyramidkv:kernel=7``):
    wider runs keep numbers that a tokenizer writes one digit per token whole.
    """

    name = "pyramidkv"

    def __init__(self, budget="0.25", beta: float = 20, window: int = 32, kernel: int = 15):
        super().__init__(budget, window, kernel)
        self.beta = float(beta)
        if self.beta < 1:
            raise ValueError(f"beta must be at least 1 (the top layer keeps 1/beta of the mean), got {beta}")

    def __repr__(self) -> str:
        return f"pyramidkv(budget={self.budget}, beta={self.beta:g})"

    def new_state(self, cache, n: int) -> BudgetState:
        st = super().new_state(cache, n)
        if st.full and st.kept < n:
            shares = pyramid(len(st.full), st.kept - st.window, st.cap, self.beta)
            st.budgets = dict(zip(st.full, shares))
        return st

    def store_selected(self, cache, layer, kv, scores):
        st = cache.state
        cache.store_layer(layer, kv, with_window(self.votes(scores, st), st.budgets[layer], st.n))
