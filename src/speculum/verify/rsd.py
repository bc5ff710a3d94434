"""Recursive Speculative Decoding's verification: siblings drawn without replacement.

Jeon, Gagrani, Goel, Park, Lee, Lott (2024), "Recursive Speculative Decoding: Accelerating LLM
Inference via Sampling Without Replacement", https://arxiv.org/abs/2402.14160.

The rule. A node's ``k`` children ``x_1 .. x_k`` are drawn from the draft's q *without
replacement* (RSD-C does it with Gumbel-top-k: the ``k`` largest ``log q + Gumbel`` noise), so
``x_j`` was drawn from ``q_j = norm(q with x_1 .. x_{j-1} removed)``: siblings are always distinct
and cover more of q than i.i.d. draws. Recursive rejection sampling tries them in draw order with
``p_1`` = the target's p: ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; on
rejection ``p_{j+1} = norm(max(0, p_j - q_j))``. When all are rejected the bonus token is sampled
from ``p_{k+1}``. Each stage outputs ``min(p_j, q_j) + max(0, p_j - q_j) = p_j`` in total, so by
induction the committed token follows p exactly. Using ``q`` instead of ``q_j`` (SpecInfer's
residual, exact for i.i.d. siblings) is not exact here: it under-weights the tokens already drawn.

Worked example: V = {a, b, c}, q = (0.6, 0.3, 0.1), p = (0.2, 0.5, 0.3), drafts (a, b).
``q_1 = q``: a is accepted with 0.2 / 0.6 = 1/3; else ``p_2 = norm((0, 0.2, 0.2)) = (0, .5, .5)``.
``q_2 = norm((0, 0.3, 0.1)) = (0, .75, .25)``: b is accepted with 0.5 / 0.75 = 2/3; else
``p_3 = norm(max(0, (0, .5, .5) - (0, .75, .25))) = (0, 0, 1)``: the bonus token is c.
SpecInfer's residual would instead try b against ``q`` (accept 0.5 / 0.3 -> 1, always).

Drafters: :func:`gumbel_top_k` draws the siblings; mark the tree ``siblings="without_replacement"``
with each sibling's ``draft_probs`` row the full q at its parent (not ``q_j``: the verifier removes
the earlier siblings itself). Nodes with one child are ordinary chain steps.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree
from . import Verifier


def gumbel_top_k(q: torch.Tensor, k: int, generator: torch.Generator | None = None) -> list[int]:
    """``k`` distinct tokens drawn from ``q`` ``[V]`` without replacement, in draw order: the ``k``
    largest ``log q + G`` (G i.i.d. standard Gumbel noise); at most the number of tokens with mass."""
    k = min(k, int((q > 0).sum()))
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))  # [V]
    keys = torch.log(q.double()) + gumbel  # [V]; -inf where q = 0
    return torch.topk(keys, k).indices.tolist()


def without_replacement_q(q: torch.Tensor, drawn: list[int]) -> torch.Tensor:
    """``q_j``: ``q`` ``[V]`` with the tokens ``drawn`` before removed, renormalized."""
    if not drawn:
        return q
    rest = q.clone()
    rest[drawn] = 0.0
    total = rest.sum()
    return rest / total if total > 0 else rest


class RSDVerifier(Verifier):
    """Recursive rejection sampling over siblings drawn without replacement (see the module)."""

    name = "rsd"
    siblings = "without_replacement"

    def pick_child(self, tree: DraftTree, children: list[int], p: torch.Tensor) -> tuple[int | None, torch.Tensor]:
        if tree.draft_probs is None:  # point masses: distinct tokens, SpecInfer's residual is RSD's
            return super().pick_child(tree, children, p)
        drawn: list[int] = []
        for c in children:
            x = tree.tokens[c]
            q = without_replacement_q(tree.draft_probs[c].to(p.device, torch.float32), drawn)  # [V]
            if self._uniform() < (p[x] / q[x]).item():
                return c, p
            p = self.residual(p, q)
            drawn.append(x)
        return None, p
