"""Sampled draft trees: every node's token is *drawn* from the drafter's distribution, so that
multi-draft speculative sampling (SpecInfer's rule in :mod:`speculum.verify`) accepts it with
``min(1, p/q)`` and the output keeps the target's distribution exactly.

Siblings are drawn *without replacement* (Recursive Speculative Decoding, Jeon et al. 2024,
https://arxiv.org/abs/2402.14160): sibling ``j`` is drawn from q with siblings ``0..j-1`` removed
and renormalised, and that renormalised row is its draft probability. After a rejection of sibling
``j`` the verifier's residual ``norm(max(0, p - q_j))`` gives sibling ``j``'s token probability 0,
so the next sibling's renormalised q is the right proposal for it.

What keeps it exact: whether a node exists is decided before its token is drawn (from its
ancestors' and earlier siblings' tokens only), and no drawn node is dropped afterwards. So the tree
carries no scores (the engine's tree sizer, which keeps the best-scoring nodes, must not trim it:
keeping a sampled token because it is likely biases what is verified). Which nodes get children
*may* depend on their own token (that only shapes what happens after they are accepted).

Growth, depth by depth: the root gets ``width`` distinct children; each further depth expands
``width`` nodes of the last depth, each getting ``width`` distinct children, until ``depth`` depths
or ``max_nodes`` nodes (where ``max_nodes`` is short of ``width`` per depth, ``width`` shrinks to
``max_nodes // depth``: depth pays before width). Which nodes: those with the fewest *detours* (a node drawn after a sibling
is one more than its parent), then the highest path probability (the product of their draft
probabilities). The verifier tries siblings in the order they were drawn and the first is accepted
with probability ``sum_x min(p, q)``, a later one only after every earlier one was rejected; so the
path of first-drawn children, which is exactly the sampled chain, is always grown to full depth
and the tree accepts at least what that chain would.

Example (``width=2``): root q = {cat: .6, dog: .3, a: .1}; draw "cat" from q, then "dog" from
{dog: .75, a: .25}; rows [q, q without cat]. Expanding both draws two children of each; the next
depth expands cat's first child (no detour) and the likelier of cat's second and dog's first.

Shapes: ``V`` vocabulary, ``n`` drafted nodes, ``m`` nodes expanded by one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..tree import DraftTree


def draw_distinct(q: torch.Tensor, count: int, generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor]]:
    """Up to ``count`` distinct tokens from ``q`` ``[V]`` without replacement, and ``[V]`` each was
    drawn from (q without the earlier ones, renormalised); fewer where q's support runs out."""
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    rest = q.float().clone()
    for _ in range(count):
        total = float(rest.sum())
        if total <= 0.0:
            break
        row = rest / total
        tok = int(torch.multinomial(row, 1, generator=generator))
        tokens.append(tok)
        rows.append(row)
        rest[tok] = 0.0
    return tokens, rows


def grow_sampled_tree(root_q: torch.Tensor, depth: int, width: int, max_nodes: int,
                      generator: torch.Generator | None,
                      expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
                      ends: frozenset[int] = frozenset()) -> DraftTree:
    """A sampled tree (see the module docstring) below a root whose next-token distribution is
    ``root_q`` ``[V]``. ``expand(tokens, parents, frontier) -> [m, V]``: the drafter's distributions
    after each frontier node, given the tree made so far. Nodes whose token is one of ``ends`` get
    no children."""
    width = min(width, max(1, max_nodes // max(depth, 1)))  # a small budget: deep before wide
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []
    path_prob: list[float] = []
    detours: list[int] = []  # [n] how many of a node's path's nodes were not their parent's first draw
    frontier, dists = [-1], root_q.unsqueeze(0)
    for level in range(depth):
        made: list[int] = []
        for node, q in zip(frontier, dists):
            room = max_nodes - len(tokens)
            drawn, drawn_rows = draw_distinct(q, min(width, room), generator)
            base = path_prob[node] if node >= 0 else 1.0
            before = detours[node] if node >= 0 else 0
            for rank, (tok, row) in enumerate(zip(drawn, drawn_rows)):
                made.append(len(tokens))
                tokens.append(tok)
                parents.append(node)
                rows.append(row)
                path_prob.append(base * float(q[tok]))
                detours.append(before + (rank > 0))
        if level + 1 == depth or len(tokens) >= max_nodes:
            break
        best = sorted(made, key=lambda i: (detours[i], -path_prob[i]))[:width]
        frontier = [i for i in best if tokens[i] not in ends]
        if not frontier:
            break
        dists = expand(tokens, parents, frontier)
    return DraftTree(tokens, parents, torch.stack(rows) if rows else None)
