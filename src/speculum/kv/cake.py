"""``cake``: CAKE (Qin et al., 2025, "CAKE: Cascading and Adaptive KV Cache Eviction with Layer
Preferences"). Each full-attention layer's share of the budget follows its *preference*, measured
on the attention ``A [heads, w, n - w]`` that the observation window's ``w`` queries pay the prompt
before the window:

- spatial dispersion ``H = -sum A log A`` (entropy: attention spread over many tokens),
- temporal dispersion ``V``: the variance of each token's attention across the window's queries,
  summed over heads and tokens (attention that moves from query to query),
- preference ``P = H^(1/tau1) * V^(1/tau2)``, and layer ``l``'s share ``P_l / sum P`` of the total.

*Cascading*: the split is made as layers are prefilled. Once layer ``l`` is done, layers
``0 .. l`` split the whole total in proportion to their preferences, and the earlier ones whose
share shrank evict down to it; memory never exceeds the total during prefill, and after the last
layer the split is the one over all layers (up to rounding: a share is never raised back).

Within a layer the *eviction indicator* ranks tokens: the mean plus ``gamma`` times the variance
of each token's attention across the window's queries, average-pooled over ``kernel`` tokens and
averaged over each KV group's query heads; a layer keeps its best ones and the window itself.

Example: 2 full-attention layers, total 20 before the windows, preferences 3 then 1. After layer
0, it alone may keep 20 (capped at ``n - w``); after layer 1 the split is 15 and 5, so layer 0
evicts its 5 lowest-indicator entries and layer 1 keeps its best 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .budgets import BudgetPolicy, BudgetState, apportion, avg_pool, with_window
from .scoring import top_slots


@dataclass
class CakeState(BudgetState):
    """The cascade so far: each stored full-attention layer's preference and indicators."""

    prefs: dict[int, float] = field(default_factory=dict)  # layer -> P
    marks: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_kv, budget] indicator of the
    # entries it keeps before its window, in slot order


def _var(a: torch.Tensor, dim: int) -> torch.Tensor:
    """Sample variance along ``dim`` (0 for a single sample)."""
    return a.var(dim) if a.shape[dim] > 1 else torch.zeros_like(a.select(dim, 0))


def preference(rows: torch.Tensor, tau1: float, tau2: float) -> float:
    """``P = H^(1/tau1) * V^(1/tau2)`` from the window's attention ``rows [H_kv, g, w, N]`` over the
    ``N`` tokens before it."""
    entropy = float(-(rows * torch.log(rows + 1e-10)).sum())
    variance = float(_var(rows, 2).sum())
    return max(entropy, 0.0) ** (1 / tau1) * max(variance, 0.0) ** (1 / tau2)


def indicator(rows: torch.Tensor, gamma: float, kernel: int) -> torch.Tensor:
    """The eviction indicator ``[H_kv, N]`` from ``rows [H_kv, g, w, N]``: mean + ``gamma`` * variance
    across the window's queries, average-pooled over ``kernel`` tokens, averaged over the group."""
    heads, g, _, width = rows.shape
    score = rows.mean(2) + gamma * _var(rows, 2)  # [H_kv, g, N]
    return avg_pool(score.flatten(0, 1), kernel).view(heads, g, width).mean(1)


class CakePolicy(BudgetPolicy):
    """Per-layer budgets by attention dispersion (``tau1``, ``tau2``), split in cascade during prefill;
    tokens ranked by mean + ``gamma`` * variance of their attention over the ``window`` observation
    queries, average-pooled over ``kernel`` tokens (the paper's defaults: 1, 1, 200, 32 and 5).

    The paper's code also evicts while decoding, to hold each layer's budget; here selection is at
    prefill only and later tokens are appended, so that a step's outcome does not depend on how the
    drafts grouped tokens into steps.
    """

    name = "cake"
    prefill_scores = "window_rows"

    def __init__(self, budget="0.25", tau1: float = 1.0, tau2: float = 1.0, gamma: float = 200.0,
                 window: int = 32, kernel: int = 5):
        super().__init__(budget, window, kernel)
        self.tau1, self.tau2, self.gamma = float(tau1), float(tau2), float(gamma)
        if self.tau1 <= 0 or self.tau2 <= 0 or self.gamma < 0:
            raise ValueError(f"tau1 and tau2 must be positive and gamma not negative, got {tau1}, {tau2}, {gamma}")

    def __repr__(self) -> str:
        return f"cake(budget={self.budget}, tau1={self.tau1:g}, tau2={self.tau2:g}, gamma={self.gamma:g})"

    def new_state(self, cache, n: int) -> CakeState:
        st = super().new_state(cache, n)
        return CakeState(st.n, st.kept, st.window, st.full)

    def store_selected(self, cache, layer, kv, scores):
        st: CakeState = cache.state
        g = cache.layout.group
        rows = scores.unflatten(1, (g, scores.shape[1] // g))[..., : st.cap]  # [H_kv, g, w, n - w]
        st.prefs[layer] = preference(rows, self.tau1, self.tau2)
        marks = indicator(rows, self.gamma, self.kernel)  # [H_kv, n - w]
        done = [i for i in st.full if i in st.prefs]
        shares = dict(zip(done, apportion([st.prefs[i] for i in done], st.total, st.cap)))
        for i in done:
            if i != layer and shares[i] < st.budgets[i]:  # earlier layers give up what the new one takes
                self.shrink(cache, i, shares[i])
        keep = with_window(marks, shares[layer], st.n)  # [H_kv, b + w]
        st.budgets[layer] = shares[layer]
        st.marks[layer] = marks.gather(1, keep[:, : shares[layer]])
        cache.store_layer(layer, kv, keep)

    def shrink(self, cache, layer: int, budget: int) -> None:
        """Evict a stored layer down to ``budget`` entries before its window (its lowest indicators)."""
        st: CakeState = cache.state
        old, marks = st.budgets[layer], st.marks[layer]
        best = top_slots(marks, budget)  # [H_kv, budget], indices among its first ``old`` slots
        window = torch.arange(old, old + st.window, device=best.device).expand(best.shape[0], st.window)
        cache.reselect(layer, torch.cat([best, window], dim=1))
        st.budgets[layer], st.marks[layer] = budget, marks.gather(1, best)
