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

**Batches** (SmartSpec's goodput rule). When ``B`` sequences share one forward, their trees compete
for the same rows: :meth:`TreeSizer.select_batch` pools every tree's nodes, sorts them by score and
keeps the ``N`` that maximise the batch's expected committed tokens per second::

    N* = argmax_N (B + s_(1) + ... + s_(N)) / (c_B(B + N) + overhead)

with ``c_B(rows)`` the measured cost of one forward over ``B`` sequences and ``rows`` rows in all
(:meth:`CostModel.batch_cost`). A one-token step is nearly free beside a single sequence's
forward but not beside fifteen others', so speculation shrinks as the batch grows and stops where
the rows buy more when spent on other users.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .tree import DraftTree


@dataclass
class CostModel:
    """Forward time in seconds as a function of new tokens ``n`` and cached context ``L``.

    Attributes:
        tokens: ``[k]`` increasing token counts measured (1 first).
        contexts: ``[m]`` increasing context lengths measured.
        seconds: ``[m][k]`` median forward time at ``contexts[j]`` over ``tokens[i]`` new tokens.
        sequences: ``[p]`` batch sizes measured by the batched forward (empty: not measured).
        rows: ``[q]`` rows per sequence measured in the batched forward.
        batch_context: cached entries of each sequence in those measurements.
        batch_seconds: ``[p][q]`` median time of one forward over ``sequences[a]`` sequences with
            ``rows[b]`` rows each.
    """

    tokens: list[int]
    contexts: list[int]
    seconds: list[list[float]]
    sequences: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    batch_context: int = 0
    batch_seconds: list[list[float]] = field(default_factory=list)

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

    def batch_cost(self, sequences: int, rows: int, context: int) -> float:
        """Forward time over ``sequences`` sequences with ``rows`` rows in all and ``context`` cached
        entries in all: the batch table at the mean rows per sequence, interpolated over the batch
        size, plus the single-sequence curve's cost per cached entry for the difference in context.
        Without a batch table, one sequence's cost over ``rows`` rows after ``context`` entries."""
        if sequences <= 1 or not self.sequences:
            return self.cost(rows, context)
        per_seq = rows / sequences
        base = _interp(self.sequences, [_interp(self.rows, r, per_seq) for r in self.batch_seconds], sequences)
        c0, c1 = self.contexts[0], self.contexts[-1]
        slope = (self.cost(1, c1) - self.cost(1, c0)) / (c1 - c0) if c1 > c0 else 0.0
        return max(base + slope * (context - sequences * self.batch_context), 1e-9)

    def _at(self, j: int, n: int) -> float:
        return _interp(self.tokens, self.seconds[j], n)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(list(d["tokens"]), list(d["contexts"]), [list(r) for r in d["seconds"]],
                   list(d.get("sequences", [])), list(d.get("rows", [])), int(d.get("batch_context", 0)),
                   [list(r) for r in d.get("batch_seconds", [])])


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through increasing ``xs``; constant below them, and beyond the last
    one the last segment's slope."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == 0 or len(xs) == 1:
        return ys[0]
    if i >= len(xs):
        i = len(xs) - 1
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def best_size(scores_desc: list[float], cost: CostModel, context: int, overhead_s: float = 0.0,
              fixed_rows: int = 0) -> int:
    """Number of nodes to keep: ``argmax_N (1 + sum(scores_desc[:N])) / (c(N + 1 + fixed_rows) + overhead)``
    (``fixed_rows``: rows the forward carries whatever is kept, e.g. prompt rows after the root).

    ``scores_desc`` must be sorted in decreasing order.
    """
    best_n, best_rate, expected = 0, 1.0 / (cost.cost(1 + fixed_rows, context) + overhead_s), 1.0
    for n, s in enumerate(scores_desc, start=1):
        expected += s
        rate = expected / (cost.cost(n + 1 + fixed_rows, context) + overhead_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


# A cautious stand-in curve for a server whose calibration is still being measured: each step's rows
# cost like a CPU's quantized kernels (16 tokens 4x one), which keeps trees small, so that they pay
# on slower machines too; only the ratios matter (no drafter overhead is added to it)
PROVISIONAL = CostModel([1, 2, 4, 8, 12, 16, 24, 32, 48, 64], [64],
                        [[0.010, 0.0115, 0.014, 0.022, 0.031, 0.040, 0.058, 0.075, 0.110, 0.150]])


class TreeSizer:
    """Trims each drafted tree to the node count that maximises expected tokens per second.

    ``cost``: the hardware's cost curve, or a function that measures it, called when a tree is first
    sized (a method is built without calibrating the machine; its first scored tree does)."""

    def __init__(self, cost: CostModel | Callable[[], CostModel], overhead_s: float = 0.0):
        self._cost, self.overhead_s = cost, overhead_s

    @property
    def cost(self) -> CostModel:
        """The cost curve; :data:`PROVISIONAL` while a server measures it in the background."""
        if not isinstance(self._cost, CostModel):
            cost = self._cost()
            if cost is None:
                return PROVISIONAL
            self._cost = cost
        return self._cost

    def select(self, tree: DraftTree, context: int) -> DraftTree:
        """The best-scoring nodes of ``tree`` worth verifying after ``context`` cached tokens (the
        tree's prompt rows after the root, which stay whatever is kept, count in the cost).

        Trees without scores are returned unchanged (the drafter sized them itself).
        """
        if tree.scores is None or len(tree) == 0:
            return tree
        depth = tree.depths()
        # a node's score capped by its ancestors' (nodes come parents first): a child whose score rounds
        # above its parent's must not be kept without it
        score: list[float] = []
        for i, p in enumerate(tree.parents):
            score.append(tree.scores[i] if p < 0 else min(tree.scores[i], score[p]))
        order = sorted(range(len(tree)), key=lambda i: (-score[i], depth[i], i))
        fixed = 0 if tree.prompts is None else sum(a < 0 for a in tree.prompts.anchors)
        n = best_size([score[i] for i in order], self.cost, context, self.overhead_s, fixed)
        if n == len(tree):
            return tree
        return tree.subtree(sorted(order[:n]))

    def select_batch(self, trees: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        """Size the trees of ``B`` sequences that share one forward (``contexts[j]``: sequence
        ``j``'s cached entries) for the batch's expected tokens per second (see the module doc).
        Trees without scores keep every node, and their rows count in the cost."""
        b = len(trees)
        fixed_rows = b + sum(len(t) for t in trees if t.scores is None)
        pooled = []  # (-score, depth, tree, node): every scored node, best first
        for j, t in enumerate(trees):
            if t.scores is not None:
                depth = t.depths()
                pooled += [(-t.scores[i], depth[i], j, i) for i in range(len(t))]
        if not pooled:
            return trees
        pooled.sort()
        context = sum(contexts)
        best_n, expected = 0, float(b)  # the bonus tokens; unscored nodes are not counted on
        best_rate = expected / (self.cost.batch_cost(b, fixed_rows, context) + self.overhead_s)
        for n, (neg, *_rest) in enumerate(pooled, start=1):
            expected -= neg
            rate = expected / (self.cost.batch_cost(b, fixed_rows + n, context) + self.overhead_s)
            if rate > best_rate:
                best_n, best_rate = n, rate
        keep: dict[int, list[int]] = {j: [] for j, t in enumerate(trees) if t.scores is not None}
        for _, _, j, i in pooled[:best_n]:
            keep[j].append(i)
        return [t if j not in keep or len(keep[j]) == len(t) else t.subtree(sorted(keep[j]))
                for j, t in enumerate(trees)]
