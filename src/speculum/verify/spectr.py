"""SpecTr's verification: k i.i.d. drafts, k-sequential selection (K-SEQ).

Sun, Suresh, Ro, Beirami, Jain, Yu (2023), "SpecTr: Fast Speculative Decoding via Optimal
Transport", https://arxiv.org/abs/2310.15141.

The rule. Picking one of ``k`` i.i.d. drafts ``x_1 .. x_k ~ q`` so that the output follows p is an
optimal-transport problem; K-SEQ is the paper's cheap rule within ``1 - 1/e`` of the optimum. With a
parameter ``rho`` in ``[1, k]``, let ``beta = sum_x min(q(x), p(x) / rho)``. Try the drafts in
order: ``x_i`` is accepted with probability ``min(1, p(x_i) / (rho q(x_i)))``. The token x is thus
accepted with total probability ``min(q(x), p(x) / rho) * c`` where ``c = (1 - (1 - beta)^k) / beta``;
that is at most p(x) whenever ``c <= rho``. When every draft is rejected the output is sampled
from the residual ``norm(p - min(q, p / rho) * c)``, which tops the accepted mass up to p exactly.
Acceptance ``1 - (1 - beta)^k`` falls as rho grows, so rho is the smallest value with
``c(rho) <= rho`` (the paper's choice; found here by bisection). For ``k = 1``, ``rho = 1`` and
this is Leviathan/Chen's rule.

Worked example: q = (0.5, 0.5, 0), p = (0.4, 0.2, 0.4), k = 2. At rho = 1, beta = 0.4 + 0.2 =
0.6 and c = (1 - 0.4^2) / 0.6 = 1.4 > 1: infeasible. Bisection finds rho = 1.632, where
beta = 0.245 + 0.1225 = 0.3675 and c = (1 - 0.6325^2) / 0.3675 = 1.632: the first draft, say a, is
accepted with 0.4 / (1.632 * 0.5) = 0.49; a accepted at either try has total probability
0.245 * 1.632 = 0.4 = p(a), so the residual gives a nothing more.

In a tree, a node's children are its ``k`` drafts, each carrying the same ``draft_probs`` row
(``siblings="iid"``, the tree's default). Children whose rows differ were not drawn from one q:
there the verifier uses SpecInfer's sequential rule, exact for independent draws from any q's.
"""

from __future__ import annotations

import numpy as np
import torch

from ..tree import DraftTree
from . import Verifier

BISECTION_STEPS = 30  # rho within (k - 1) / 2^30 of the smallest feasible value


def k_seq_rho(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """The smallest ``rho`` in ``[1, k]`` with ``c(rho) <= rho`` (to bisection precision, always on
    the feasible side), for target ``p`` and draft ``q`` ``[V]`` and ``k`` drafts."""
    pn, qn = p.double().cpu().numpy(), q.double().cpu().numpy()  # [V] each; numpy: no per-op overhead
    if k <= 1 or _gain(pn, qn, k, 1.0) <= 1.0:
        return 1.0
    lo, hi = 1.0, float(k)
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        if _gain(pn, qn, k, mid) <= mid:
            hi = mid
        else:
            lo = mid
    return hi


def _gain(p: np.ndarray, q: np.ndarray, k: int, rho: float) -> float:
    """``c(rho) = (1 - (1 - beta)^k) / beta``: how much the k tries multiply one try's acceptance."""
    beta = float(np.minimum(q, p / rho).sum())
    return float(k) if beta <= 0 else (1.0 - (1.0 - beta) ** k) / beta


def k_seq_residual(p: torch.Tensor, q: torch.Tensor, k: int, rho: float) -> torch.Tensor:
    """``[V]`` the distribution to sample from after all ``k`` drafts were rejected."""
    accepted = torch.minimum(q, p / rho)  # [V] one try's acceptance mass per token
    gain = _gain(p.double().cpu().numpy(), q.double().cpu().numpy(), k, rho)
    r = (p - accepted * gain).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


class SpecTrVerifier(Verifier):
    """K-SEQ over a node's i.i.d. drafts (see the module)."""

    name = "spectr"
    siblings = "iid"

    def pick_child(self, tree: DraftTree, children: list[int], p: torch.Tensor) -> tuple[int | None, torch.Tensor]:
        if tree.draft_probs is None or len(children) < 2 or not self._one_q(tree, children):
            return super().pick_child(tree, children, p)
        q = tree.draft_probs[children[0]].to(p.device, torch.float32)  # [V]
        rho = k_seq_rho(p, q, len(children))
        for c in children:
            x = tree.tokens[c]
            if self._uniform() * rho * q[x].item() < p[x].item():
                return c, p
        return None, k_seq_residual(p, q, len(children), rho)

    @staticmethod
    def _one_q(tree: DraftTree, children: list[int]) -> bool:
        first = tree.draft_probs[children[0]]
        return all(torch.equal(first, tree.draft_probs[c]) for c in children[1:])
