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
    _context, _depth, rank = key
    return 0.45 / (1 + 2 * rank)


class RecyclingDrafter(Drafter):
    """Token Recycling.

    Args:
        k: candidates kept per token (the matrix's width; the paper uses 8).
        max_depth: deepest node drafted.
        max_nodes: most nodes drafted per step before the engine's sizer trims.
        pair_context: also keep candidates keyed by the last *two* tokens (the token and its
            predecessor), preferred over the one-token row when present. The paper's matrix
            is context-free; a two-token key tells apart the contexts a frequent token appears
            in. ``False`` gives the paper's rule.
    """

    name = "recycling"

    def __init__(self, k: int = 8, max_depth: int = 12, max_nodes: int = 64, pair_context: bool = True,
                 max_pairs: int = 200_000):
        self.k, self.max_depth, self.max_nodes = k, max_depth, max_nodes
        self.pair_context, self.max_pairs = pair_context, max_pairs
        self.matrix: np.ndarray | None = None  # [V, k] int64, -1 = no candidate yet
        self.pairs: dict[tuple[int, int], np.ndarray] = {}  # (previous, token) -> [k] candidates
        self.rates = HitRates(prior=_prior)

    def _row(self, prev: int, tok: int) -> tuple[np.ndarray | None, int]:
        """Candidates after ``prev, tok``: ``(row [k], 1)`` from the pair table, else ``(M[tok], 0)``."""
        if self.pair_context:
            row = self.pairs.get((prev, tok))
            if row is not None:
                return row, 1
        if tok >= self.matrix.shape[0] or self.matrix[tok][0] < 0:
            return None, 0
        return self.matrix[tok], 0

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

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        builder = TreeBuilder()
        self.expand(builder, tokens, min(budget, self.max_nodes))
        return builder.build()

    def learn(self, inputs: list[int], prevs: list[int], logits: torch.Tensor) -> None:
        """Store the top-k of ``logits`` ``[n + 1, V]`` as the candidates after each of ``inputs``
        ``[n + 1]`` (and after each pair ``prevs[i], inputs[i]``); later rows win."""
        if self.matrix is None:
            self.matrix = np.full((logits.shape[-1], self.k), -1, dtype=np.int64)
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
        record_tree(self.rates, SOURCE, tree, logits, acceptance)
        self.learn(inputs, prevs, logits)
