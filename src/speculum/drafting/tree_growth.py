"""Draft trees grown from model scores: EAGLE-2's dynamic tree (Li et al. 2024), for every drafter
that scores a node's children with a model (``eagle``, ``hydra``, ``kangaroo``, the self-drafts and
draft models differ only in how they expand a node: :meth:`DynamicTree.grow`), Medusa's product
tree (:func:`product_tree`, for ``medusa`` and ``ppd``, whose candidates at a depth do not depend
on the parent), and the sampled chain (:func:`sample_chain`) those drafters propose when sampling.

Each node's score is its path's cumulative draft log-probability. Growth, depth by depth:

- the root's ``top_k`` most likely tokens become the first depth;
- each further depth expands the ``top_k`` best-scoring nodes of the last depth (one batched model
  call for all of them, the drafter's), each giving its ``top_k`` most likely children; a node whose
  path probability is below ``min_path_prob`` is not expanded, and growth stops where none is left;
- the result reranks every node created and keeps the best ``max_nodes`` (a child never outscores
  its parent, so they form a tree), with ``exp(score)`` as each node's acceptance estimate for the
  engine's tree sizer.

Example (``top_k=2``): root children "cat" (log .6) and "dog" (log .3); expanding both gives
"cat sat" (.6 x .5), "cat is", "dog ran" (.3 x .9), "dog has"; with ``max_nodes=4`` the tree keeps
cat, dog, cat-sat, dog-ran.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np
import torch

from ..tree import DraftTree


class DynamicTree:
    """One step's growing tree: ``tokens``, ``parents`` and ``scores`` ``[n]`` of the nodes made so far."""

    def __init__(self, top_k: int, min_path_prob: float = 0.0, ends: frozenset[int] = frozenset()):
        self.top_k, self.ends = top_k, ends
        self.min_log_prob = math.log(min_path_prob) if min_path_prob > 0 else -math.inf
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []

    def add_children(self, nodes: list[int], logp: torch.Tensor, token_ids=None) -> list[int]:
        """The ``top_k`` children of each of ``nodes`` (``-1``: the root) from their log-probabilities
        ``logp [len(nodes), K]``; ``token_ids``: maps a column to a token id (a trimmed draft
        vocabulary; default the identity). Returns the new nodes."""
        top = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
        ids = top.indices if token_ids is None else token_ids(top.indices)
        made = []
        for node, row_ids, row_vals in zip(nodes, ids.tolist(), top.values.tolist()):
            base = self.scores[node] if node >= 0 else 0.0
            for tok, lp in zip(row_ids, row_vals):
                made.append(len(self.tokens))
                self.tokens.append(tok)
                self.parents.append(node)
                self.scores.append(base + lp)
        return made

    def add_path(self, node: int, tokens: list[int], prob: float) -> None:
        """``tokens`` as a chain under ``node``, each scored ``prob`` times its parent: a continuation
        proposed without model scores (a lookup), its per-token acceptance estimated as ``prob``."""
        step = math.log(prob)
        for tok in tokens:
            base = self.scores[node] if node >= 0 else 0.0
            self.tokens.append(tok)
            self.parents.append(node)
            self.scores.append(base + step)
            node = len(self.tokens) - 1

    def frontier(self, level: list[int]) -> list[int]:
        """The nodes of ``level`` to expand next: the ``top_k`` best above ``min_path_prob``, none
        whose token is one of ``ends`` (the request's EOS ids: nothing after one can be committed)."""
        best = sorted(level, key=lambda i: -self.scores[i])[:self.top_k]
        return [i for i in best if self.scores[i] >= self.min_log_prob and self.tokens[i] not in self.ends]

    def confident(self, nodes: list[int], min_prob: float) -> list[int]:
        """The ``nodes`` whose own token, given its parent, has probability at least ``min_prob`` (the
        early exit of a chain: Kangaroo's, SWIFT's); ``min_prob=0`` keeps them all."""
        floor = math.log(min_prob) if min_prob > 0 else -math.inf
        return [i for i in nodes
                if self.scores[i] - (self.scores[self.parents[i]] if self.parents[i] >= 0 else 0.0) >= floor]

    def expansion_mask(self, nodes: list[int], used: int, slots: dict[int, int],
                       ancestors: dict[int, list[int]]) -> np.ndarray:
        """What rows expanding ``nodes`` see among a draft cache's pending entries, the rows written at
        slots ``used .. used + m - 1``: their ancestors' entries and their own, ``[m, used + m]`` bool.
        ``slots`` (node -> its entry's slot) and ``ancestors`` (node -> its ancestors' slots; ``-1``,
        the root, given by the caller) are extended with ``nodes``."""
        visible = np.zeros((len(nodes), used + len(nodes)), dtype=bool)
        for r, node in enumerate(nodes):
            parent = self.parents[node]
            ancestors[node] = ancestors[parent] + ([slots[parent]] if parent >= 0 else [])
            visible[r, ancestors[node]] = True
            slots[node] = used + r
            visible[r, used + r] = True
        return visible

    def grow(self, level: list[int], expansions: int, expand: Callable[[list[int], int], torch.Tensor],
             token_ids=None, look_up: Callable[[list[int]], bool] | None = None,
             min_confidence: float | None = None) -> None:
        """Grow the tree below ``level`` (the depth made last) by up to ``expansions`` depths. At each,
        ``look_up(level)`` may hang a continuation found in the text under it and end the growth (it
        returns True); the :meth:`frontier` (cut to the :meth:`confident` nodes where ``min_confidence``
        is given) is expanded by ``expand(frontier, e) -> logp [m, K]`` (``e = 1, 2, ...``: the
        expansion's number), its children (``token_ids`` as in :meth:`add_children`) the next level.
        Growth ends early where the frontier is empty; after the last expansion ``look_up`` sees the
        final level."""
        for e in range(1, expansions + 1):
            if look_up is not None and look_up(level):
                return
            frontier = self.frontier(level)
            if min_confidence is not None:
                frontier = self.confident(frontier, min_confidence)
            if not frontier:
                return
            level = self.add_children(frontier, expand(frontier, e), token_ids)
        if look_up is not None:
            look_up(level)

    def path(self, node: int) -> list[int]:
        """The tokens from the first depth down to ``node``."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def result(self, max_nodes: int) -> DraftTree:
        """The best ``max_nodes`` nodes as a :class:`DraftTree` with their acceptance estimates."""
        best = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:max(0, max_nodes)]
        kept: set[int] = set()
        keep: list[int] = []
        for i in sorted(best):  # creation order is topological; a tie may have cut a parent
            if self.parents[i] < 0 or self.parents[i] in kept:
                keep.append(i)
                kept.add(i)
        tree = DraftTree(self.tokens, self.parents, scores=[math.exp(s) for s in self.scores])
        return tree.subtree(keep)


def sample_chain(logits: torch.Tensor, k: int, params, generator: torch.Generator | None,
                 advance: Callable[[int, int], torch.Tensor], ends: frozenset[int] = frozenset(),
                 look_up: Callable[[list[int]], list[int]] | None = None, min_confidence: float = 0.0) -> DraftTree:
    """A chain of up to ``k`` tokens sampled from a drafter's distributions, with them as its draft
    probabilities (what sampled verification needs): token ``i`` from ``params.probs(logits)``
    (``logits [V]``), then ``logits = advance(token, i)`` for the next. The chain ends after an end
    token, after a token whose probability is below ``min_confidence``, or where ``look_up(drafted)``
    finds a continuation in the text (appended as certain tokens: a point mass each)."""
    drafted, qs = [], []
    for i in range(k):
        q = params.probs(logits)
        tok = int(torch.multinomial(q, 1, generator=generator))
        drafted.append(tok)
        qs.append(q)
        if tok in ends:
            break
        found = look_up(drafted) if look_up is not None else None
        if found:
            drafted += found
            qs += torch.nn.functional.one_hot(torch.tensor(found, device=q.device), q.shape[-1]).to(q.dtype)
            break
        if i + 1 == k or float(q[tok]) < min_confidence:
            break
        logits = advance(tok, i)
    return DraftTree.chain(drafted, torch.stack(qs))


def product_tree(ids: list[list[int]], logp: list[list[float]], max_nodes: int) -> DraftTree:
    """Medusa's tree: depth ``d`` holds candidates ``ids[d - 1]`` (ranked, log-probabilities
    ``logp[d - 1]``) under every parent; nodes taken best-first by the sum of their path's
    log-probabilities up to ``max_nodes``, scored ``exp`` of it (a child never outscores its parent).

    Example (two depths): ``ids=[[cat, dog], [sat, ran]]`` with probabilities ``[[.6, .3], [.5, .2]]``
    -> cat (.6), cat-sat (.3), dog (.3), dog-sat (.15), cat-ran (.12), ...
    """
    tokens, parents, scores = [], [], []
    if not ids or not ids[0]:
        return DraftTree()
    # (-score, depth, rank, parent): a popped entry becomes a node and offers its next sibling (same
    # parent, next rank) and its first child (next depth, rank 0)
    heap = [(-logp[0][0], 0, 0, -1)]
    while heap and len(tokens) < max_nodes:
        neg, d, r, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d][r])
        parents.append(parent)
        scores.append(-neg)
        base = scores[parent] if parent >= 0 else 0.0
        if r + 1 < len(ids[d]):
            heapq.heappush(heap, (-(base + logp[d][r + 1]), d, r + 1, parent))
        if d + 1 < len(ids):
            heapq.heappush(heap, (-(-neg + logp[d + 1][0]), d + 1, 0, node))
    return DraftTree(tokens, parents, scores=[math.exp(s) for s in scores])
