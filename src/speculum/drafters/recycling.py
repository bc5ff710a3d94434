"""``recycling``: Token Recycling (Luo et al. 2024, "Turning Trash into Treasure").

Every verification computes logits for each token in the tree, and all but the accepted path's
are usually thrown away. Token Recycling keeps them: an adjacency matrix ``M [V, k]`` holds, for
each token, the top-``k`` next-token candidates from the most recent logits computed after it.
After each step the rows of every token fed to the verification (root and tree nodes, accepted or
not) are overwritten with the top-``k`` of their logits. The matrix persists across requests (the
paper's hot start); it is sized from the logits' width, and a token whose row was never written
has no candidates (its subtree is not drafted).

The paper's tree (``tree="template"``, the default) is a static template of 80 nodes over 6
levels, filled breadth-first from ``M``: a node ``[i, j]`` is the ``j``-th candidate of the token at
node ``[i]``, itself the ``i``-th candidate of the root. A token drafted twice under one parent is
kept once, with the children of both (the reference verifies every root-to-leaf path and keeps the
longest accepted one; one node with both subtrees gives the greedy walk the same choice).

speculum's variant, ``recycling_scored`` (``tree="scored"``), grows the tree best-first by estimated
acceptance probability instead, the product along the path of learnt hit rates per (depth,
candidate rank) (:class:`~speculum.drafters.hit_rates.HitRates`), so that the engine's
:class:`~speculum.tree_sizing.TreeSizer` keeps as many nodes as this hardware pays for; with
``pair_context`` it also keeps candidates keyed by the last two tokens, preferred over the
one-token row when present (a two-token key tells apart the contexts a frequent token appears in).
``mix`` and ``auto`` use that variant.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ..tree import DraftTree, TreeBuilder
from ..verify import Acceptance
from .base import Drafter
from .hit_rates import HitRates, record_tree

SOURCE = "recycling"

# The paper's tree (reference implementation: Spec-Bench, model/recycling/tree_template_.py, version
# "2.2.2"): each node as its path of candidate ranks from the root, parents before children.
TEMPLATE = (
    [[i] for i in range(8)]
    + [[0, i] for i in range(8)] + [[1, i] for i in range(4)] + [[2, i] for i in range(3)]
    + [[3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0]]
    + [[0, 0, i] for i in range(8)] + [[0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 2, 0], [0, 2, 1], [0, 3, 0],
                                       [0, 4, 0], [0, 5, 0], [0, 6, 0], [0, 7, 0], [1, 0, 0], [1, 0, 1],
                                       [1, 1, 0], [2, 0, 0], [3, 0, 0], [4, 0, 0], [5, 0, 0]]
    + [[0, 0, 0, i] for i in range(5)] + [[0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 2, 0], [0, 0, 3, 0],
                                          [0, 0, 4, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0],
                                          [2, 0, 0, 0], [3, 0, 0, 0]]
    + [[0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0],
       [0, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    + [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0]]
)


def _prior(key) -> float:
    _context, _depth, rank = key
    return 0.45 / (1 + 2 * rank)


class RecyclingDrafter(Drafter):
    """Token Recycling.

    Args:
        k: candidates kept per token (the matrix's width; the paper uses 8).
        tree: ``"template"`` (the paper's static 80-node tree) or ``"scored"`` (best-first by learnt
            hit rates, sized by the engine).
        max_depth: deepest node drafted (``scored``).
        max_nodes: most nodes drafted per step (``scored``; the template has its own size).
        pair_context: also keep candidates keyed by the last *two* tokens (``scored`` only: the
            paper's matrix is context-free).
    """

    name = "recycling"

    def __init__(self, k: int = 8, tree: str = "template", max_depth: int = 12, max_nodes: int = 64,
                 pair_context: bool = False, max_pairs: int = 200_000):
        if tree not in ("template", "scored"):
            raise ValueError("tree must be 'template' or 'scored'")
        if pair_context and tree != "scored":
            raise ValueError("pair_context needs tree='scored'")
        self.k, self.tree, self.max_depth, self.max_nodes = k, tree, max_depth, max_nodes
        self.pair_context, self.max_pairs = pair_context, max_pairs
        self.table = _Table()  # the candidate matrix, shared by forks
        self.pairs: dict[tuple[int, int], np.ndarray] = {}  # (previous, token) -> [k] candidates
        self.rates = HitRates(prior=_prior)
        self.template = [p for p in TEMPLATE if p[-1] < k]

    @property
    def matrix(self) -> np.ndarray | None:
        """``[V, k]`` int64 candidates after each token, -1 = none yet (None before the first update)."""
        return self.table.matrix

    def _row(self, prev: int, tok: int) -> tuple[np.ndarray | None, int]:
        """Candidates after ``prev, tok``: ``(row [k], 1)`` from the pair table, else ``(M[tok], 0)``."""
        if self.pair_context:
            row = self.pairs.get((prev, tok))
            if row is not None:
                return row, 1
        if tok >= self.matrix.shape[0] or self.matrix[tok][0] < 0:
            return None, 0
        return self.matrix[tok], 0

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        builder = TreeBuilder()
        if self.tree == "template":
            self._fill_template(builder, tokens[-1], budget)
            built = builder.build()
            return DraftTree(built.tokens, built.parents)
        self.expand(builder, tokens, min(budget, self.max_nodes))
        return builder.build()

    def _fill_template(self, builder: TreeBuilder, root: int, budget: int) -> None:
        """The template's nodes, breadth-first, while the matrix has candidates (at most ``budget``)."""
        if self.matrix is None:
            return
        placed: dict[tuple[int, ...], tuple[int, int]] = {(): (-1, root)}  # path -> (tree node, token)
        for path in self.template:
            parent = placed.get(tuple(path[:-1]))
            if parent is None or len(builder) >= budget:
                continue
            node, tok = parent
            if tok >= self.matrix.shape[0] or self.matrix[tok, path[-1]] < 0:
                continue
            child = int(self.matrix[tok, path[-1]])
            placed[tuple(path)] = (builder.add(node, child, 1.0), child)

    def expand(self, builder: TreeBuilder, tokens: list[int], budget: int) -> None:
        """Grow ``builder`` below the root (``tokens[-1]``) best-first over the candidate rows, ``budget`` nodes."""
        if self.matrix is None or budget <= 0:
            return
        rates, limit = self.rates, len(builder) + budget
        # heap: (-score, tie, parent node, parent score, parent's token, candidate row, row kind, depth, rank)
        heap: list = []
        tie = 0
        root = tokens[-1]
        row, kind = self._row(tokens[-2] if len(tokens) > 1 else -1, root)
        if row is not None:
            heap.append((-rates.p((kind, 1, 0)), tie, -1, 1.0, root, row, kind, 1, 0))
        while heap and len(builder) < limit:
            neg, _, par, par_score, ptok, row, kind, depth, rank = heapq.heappop(heap)
            score, dkey = -neg, min(depth, 8)
            tok = int(row[rank])
            node = builder.add(par, tok, score, (SOURCE, (kind, dkey, rank)))
            tie += 1
            if rank + 1 < self.k and row[rank + 1] >= 0:
                p_sib = rates.p((kind, dkey, rank + 1))
                heapq.heappush(heap, (-par_score * p_sib, tie, par, par_score, ptok, row, kind, depth, rank + 1))
            if depth < self.max_depth:
                crow, ckind = self._row(ptok, tok)
                if crow is not None:
                    tie += 1
                    p_child = rates.p((ckind, min(depth + 1, 8), 0))
                    heapq.heappush(heap, (-score * p_child, tie, node, score, tok, crow, ckind, depth + 1, 0))

    def learn(self, inputs: list[int], prevs: list[int], logits: torch.Tensor) -> None:
        """Store the top-k of ``logits`` ``[n + 1, V]`` as the candidates after each of ``inputs``
        ``[n + 1]`` (and after each pair ``prevs[i], inputs[i]``); later rows win."""
        if self.matrix is None:
            self.table.matrix = np.full((logits.shape[-1], self.k), -1, dtype=np.int64)
        top = logits.topk(self.k, dim=-1).indices.cpu().numpy()  # [n + 1, k]
        self.matrix[np.asarray(inputs)] = top
        if self.pair_context:
            if len(self.pairs) > self.max_pairs:
                self.pairs.clear()
            for prev, tok, row in zip(prevs, inputs, top):
                self.pairs[(prev, tok)] = row

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if logits is None:
            return
        # update runs only when every token of the acceptance was committed, so the root sits
        # just before them
        at = len(tokens) - len(acceptance.tokens) - 1
        root, before_root = tokens[at], (tokens[at - 1] if at > 0 else -1)
        inputs = [root] + tree.tokens
        prevs = [before_root] + [inputs[p + 1] for p in tree.parents]
        if self.tree == "scored":
            record_tree(self.rates, SOURCE, tree, logits, acceptance)
        self.learn(inputs, prevs, logits)


@dataclass
class _Table:
    """The candidate matrix, in a holder so that forks of a drafter share it once it exists."""

    matrix: np.ndarray | None = None  # [V, k] int64
