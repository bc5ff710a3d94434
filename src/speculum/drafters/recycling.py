"""``recycling``: Token Recycling (Luo et al. 2024, "Turning Trash into Treasure").

Every verification computes logits for each token in the tree, and all but the accepted path's
are usually thrown away. Token Recycling keeps them: an adjacency matrix ``M [V, k]`` holds, for
each token, the top-``k`` next-token candidates from the most recent logits computed after it.
After each step the rows of every token fed to the verification (root and tree nodes) are
overwritten with the top-``k`` of their logits. To draft, the tree grows from the root token by
following ``M`` breadth-first-by-score: a node's children are ``M[token][:k]``.

Differences from the paper, which expands a fixed 80-node template: the tree is grown best-first
by estimated acceptance probability, the product along the path of learnt hit rates per
(depth, candidate rank) (:class:`~speculum.drafters.hit_rates.HitRates`), and the engine's
:class:`~speculum.tree_sizing.TreeSizer` keeps as many nodes as this hardware pays for. The matrix
persists across requests (the paper's hot start); it is sized from the logits' width.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ..tree import DraftTree, TreeBuilder
from ..verify import Acceptance
from .base import Drafter
from .hit_rates import HitRates, record_tree

SOURCE = "recycling"


def _prior(key) -> float:
    _depth, rank = key
    return 0.45 / (1 + 2 * rank)


class RecyclingDrafter(Drafter):
    """Token Recycling.

    Args:
        k: candidates kept per token (the matrix's width; the paper uses 8).
        max_depth: deepest node drafted.
        max_nodes: most nodes drafted per step before the engine's sizer trims.
    """

    name = "recycling"

    def __init__(self, k: int = 8, max_depth: int = 12, max_nodes: int = 64):
        self.k, self.max_depth, self.max_nodes = k, max_depth, max_nodes
        self.matrix: np.ndarray | None = None  # [V, k] int64, -1 = no candidate yet
        self.rates = HitRates(prior=_prior)

    def expand(self, builder: TreeBuilder, tokens: list[int], budget: int) -> None:
        """Grow ``builder`` below the root (``tokens[-1]``) by best-first search over ``M``, ``budget`` nodes."""
        root = tokens[-1]
        parent, base = -1, 1.0
        if self.matrix is None or budget <= 0 or root >= self.matrix.shape[0]:
            return
        m, rates, limit = self.matrix, self.rates, len(builder) + budget
        heap: list = []  # (-score, tie, parent node, parent score, parent's candidate row, depth, rank)
        tie = 0
        if m[root][0] >= 0:
            heap.append((-base * rates.p((1, 0)), tie, parent, base, m[root], 1, 0))
        while heap and len(builder) < limit:
            neg, _, par, par_score, row, depth, rank = heapq.heappop(heap)
            score, key = -neg, (min(depth, 8), rank)
            tok = int(row[rank])
            node = builder.add(par, tok, score, (SOURCE, key))
            tie += 1
            if rank + 1 < self.k and row[rank + 1] >= 0:
                sib = (key[0], rank + 1)
                heapq.heappush(heap, (-par_score * rates.p(sib), tie, par, par_score, row, depth, rank + 1))
            if depth < self.max_depth and tok < m.shape[0] and m[tok][0] >= 0:
                tie += 1
                child = (min(depth + 1, 8), 0)
                heapq.heappush(heap, (-score * rates.p(child), tie, node, score, m[tok], depth + 1, 0))

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        builder = TreeBuilder()
        self.expand(builder, tokens, min(budget, self.max_nodes))
        return builder.build()

    def learn(self, inputs: list[int], logits: torch.Tensor) -> None:
        """Overwrite the rows of ``inputs`` ``[n + 1]`` with the top-k of ``logits`` ``[n + 1, V]``."""
        if self.matrix is None:
            self.matrix = np.full((logits.shape[-1], self.k), -1, dtype=np.int64)
        top = logits.topk(self.k, dim=-1).indices.cpu().numpy()
        self.matrix[np.asarray(inputs)] = top

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if logits is None:
            return
        # update runs only when every token of the acceptance was committed, so the root sits
        # just before them
        root = tokens[-len(acceptance.tokens) - 1]
        record_tree(self.rates, SOURCE, tree, logits, acceptance)
        self.learn([root] + tree.tokens, logits)
