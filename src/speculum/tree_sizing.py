"""Hardware-aware tree sizing: keep the drafted nodes that pay for their verification cost.

The idea behind PPD's dynamic sparse trees, Sequoia and EAGLE-2's reranking, applied to any
drafter. A drafter attaches to each node an estimate ``s_i`` of the probability that the node is
accepted (its whole root path matches the target). Verifying the root plus ``N`` nodes yields
``1 + sum(s_i)`` tokens in expectation and costs ``c(N + 1, L)``: the forward time over ``N + 1``
tokens after ``L`` cached ones, measured once per model x dtype x device by
:mod:`speculum.calibrate`. The sizer sorts the nodes by score (a parent never scores below its
child, so any prefix of that order is a valid tree) and keeps the ``N`` that maximise expected
tokens per second::

    N* = argmax_N (1 + s_(1) + ... + s_(N)) / (c(N + 1, L) + overhead)

On a machine where 16 tokens cost barely more than one the chosen trees are wide; where cost
grows linearly (a float32 CPU, a small GPU) they shrink to the few nodes that are nearly sure,
and to nothing at all when no node is likely enough: drafting stops when it does not pay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .tree import DraftTree


@dataclass
class CostModel:
    """Forward time in seconds as a function of new tokens ``n`` and cached context ``L``.

    Attributes:
        tokens: ``[k]`` increasing token counts measured (1 first).
        contexts: ``[m]`` increasing context lengths measured.
        seconds: ``[m][k]`` median forward time at ``contexts[j]`` over ``tokens[i]`` new tokens.
    """

    tokens: list[int]
    contexts: list[int]
    seconds: list[list[float]]

    def cost(self, n: int, context: int) -> float:
        """Interpolated forward time over ``n`` tokens after ``context`` cached ones (seconds)."""
        j = bisect.bisect_left(self.contexts, context)
        if j <= 0 or len(self.contexts) == 1:
            return self._at(0, n)
        if j >= len(self.contexts):
            # past the last measured context: extend the last segment's slope
            j = len(self.contexts) - 1
        c0, c1 = self.contexts[j - 1], self.contexts[j]
        w = (context - c0) / (c1 - c0)
        return max((1 - w) * self._at(j - 1, n) + w * self._at(j, n), 1e-9)

    def _at(self, j: int, n: int) -> float:
        xs, ys = self.tokens, self.seconds[j]
        i = bisect.bisect_left(xs, n)
        if i < len(xs) and xs[i] == n:
            return ys[i]
        if i == 0:
            return ys[0]
        if i >= len(xs):  # beyond the largest measured count: linear from the last two points
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (n - xs[-1])
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - x0) / (x1 - x0)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "contexts": self.contexts, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(list(d["tokens"]), list(d["contexts"]), [list(r) for r in d["seconds"]])


def best_size(scores_desc: list[float], cost: CostModel, context: int, overhead_s: float = 0.0) -> int:
    """Number of nodes to keep: ``argmax_N (1 + sum(scores_desc[:N])) / (c(N + 1) + overhead)``.

    ``scores_desc`` must be sorted in decreasing order.
    """
    best_n, best_rate, expected = 0, 1.0 / (cost.cost(1, context) + overhead_s), 1.0
    for n, s in enumerate(scores_desc, start=1):
        expected += s
        rate = expected / (cost.cost(n + 1, context) + overhead_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


class TreeSizer:
    """Trims each drafted tree to the node count that maximises expected tokens per second."""

    def __init__(self, cost: CostModel, overhead_s: float = 0.0):
        self.cost, self.overhead_s = cost, overhead_s

    def select(self, tree: DraftTree, context: int) -> DraftTree:
        """The best-scoring nodes of ``tree`` worth verifying after ``context`` cached tokens.

        Trees without scores are returned unchanged (the drafter sized them itself).
        """
        if tree.scores is None or len(tree) == 0:
            return tree
        depth = tree.depths()
        order = sorted(range(len(tree)), key=lambda i: (-tree.scores[i], depth[i], i))
        n = best_size([tree.scores[i] for i in order], self.cost, context, self.overhead_s)
        if n == len(tree):
            return tree
        return tree.subtree(sorted(order[:n]))
