"""``aded``: ADED (Liu, Lei, Zhang, Xu 2024, "Adaptive Draft-Verification for Efficient Large Language
Model Decoding", https://arxiv.org/abs/2407.12021).

The rule: a *tri-gram matrix* ``P(c | a, b)``, counts of which token followed each pair of tokens,
stands in for the target model's next-token distribution. It adapts while decoding: every token
the target commits is counted, so the matrix moves toward what this model writes. Drafts are built
by a Monte-Carlo tree search over the matrix: each iteration descends from the root choosing, at
every node, the continuation ``c`` that maximizes the PUCT value

    ``Q(c) + c_puct * P(c | a, b) * sqrt(N(node)) / (1 + N(c))``

(``Q``: mean value of the node's simulations, ``N``: visit counts), which balances exploiting the
likely continuations against exploring the less visited ones. The first continuation not yet in
the tree is added to it (one draft node per iteration, so ``budget`` iterations make a ``budget``
node tree); its value, the tri-gram probability of its whole path, is backed up to the root.

speculum's reading of the parts the paper leaves to its code (the reference implementation was not
available while writing this):

- the matrix is kept in two parts: a *local* one over this request's prompt and output, counted as
  tokens are committed, and a *global* one that :meth:`AdedDrafter.finish` merges each finished
  request into (the paper's corpus-built matrix, learnt here from the requests served); a pair's
  counts are ``local_weight * local + global``. An unseen pair backs off to the bigram counts of
  its last token;
- a node is expanded over its ``top_k`` most frequent continuations only (the matrix's row,
  truncated), and the tree is at most ``max_depth`` deep;
- the value of a new node is its path probability (the product of ``P`` along the path), as in the
  paper; the search is unchanged by what follows;
- speculum's addition, not the paper's: each node also carries a *calibrated* score for the engine's
  tree sizer (:class:`~speculum.tree_sizing.TreeSizer`), its parent's score times the learnt rate at
  which tokens drafted with the same features were the target's next token
  (:class:`~speculum.drafters.hit_rates.HitRates`, shared across requests). The features are the
  matrix row's order (tri-gram or bigram back-off), the decile of ``P(c | a, b)`` and how many
  observations the row holds (1, 2-3, 4-10, more); before any observation a key's rate is its
  decile's midpoint. A tri-gram seen once claims ``P = 1`` yet is often wrong: the raw path
  probability overstates acceptance, and the sizer would then verify nodes that do not pay. With
  calibrated scores the search still builds up to the budget and the sizer keeps the prefix of
  nodes worth their rows on this hardware;
- defaults (``c_puct = 1``, ``top_k = 8``, ``max_depth = 8``, 32 nodes per step from the registry) are
  speculum's, not taken from the paper.

Example: the text ``a b c a b d a b c a b`` (the root's context is ``a b``) gives
``P(c | a, b) = 2/3``, ``P(d | a, b) = 1/3`` and ``P(a | b, c) = P(b | c, a) = 1``. Iteration 1 adds ``c``
(PUCT ``2/3`` against ``1/3``, ``c_puct = 1``); iteration 2 re-enters ``c`` (``2/3 + 2/3 * 1/2`` against
``1/3``) and adds ``a`` below it; iteration 3 adds ``b`` below ``a``. The chain ``c a b c a b`` grows
while its deeper nodes (path probability ``4/9``) pull ``Q(c)`` down and the root's exploration term
grows, until iteration 7 adds ``d`` beside ``c``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..tree import DraftTree
from ..verify import Acceptance
from .base import Drafter
from .hit_rates import HitRates, record_tree

Counts = dict[int, int]  # next token -> count
SOURCE = "aded"
Key = tuple[int, int, int]  # (row order: 3 tri-gram / 2 bigram back-off, decile of P, observations bucket)


def _evidence_bucket(observations: int) -> int:
    """Bucket of a matrix row's observation count: 0 for 1, 1 for 2-3, 2 for 4-10, 3 above."""
    return 0 if observations <= 1 else 1 if observations <= 3 else 2 if observations <= 10 else 3


def _decile(p: float) -> int:
    """``p``'s decile, 0-9 (a value a rounding error below a boundary counts as on it)."""
    return min(int(p * 10 + 1e-6), 9)


def _prior(key: Key) -> float:
    """A key's hit rate before any observation: the midpoint of its probability decile."""
    return (key[1] + 0.5) / 10


def _count(table: dict, key, token: int, weight: int = 1) -> None:
    row = table.get(key)
    if row is None:
        table[key] = {token: weight}
    else:
        row[token] = row.get(token, 0) + weight


@dataclass
class _Node:
    """One MCTS node: a drafted token (the root has token -1) and its search statistics."""

    token: int
    index: int  # its node index in the draft tree (-1: the root)
    context: tuple[int, int]  # the two tokens that end its path (the key of its matrix row)
    path_prob: float  # product of P along the path (the MCTS value)
    score: float  # calibrated estimate that the node's whole root path is accepted (for the sizer)
    depth: int
    visits: int = 0
    value_sum: float = 0.0
    children: dict[int, _Node] = field(default_factory=dict)
    candidates: list[tuple[int, float]] | None = None  # [(token, P)] best first, filled on first visit
    keys: list[Key] | None = None  # the calibration key of each candidate
    exhausted: bool = False  # nothing below it can be added any more

    @property
    def q(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0


class AdedDrafter(Drafter):
    """ADED's adaptive tri-gram matrix drafted by Monte-Carlo tree search.

    Args:
        c_puct: the exploration constant of the PUCT value.
        top_k: continuations of a matrix row considered per node.
        max_depth: deepest node drafted.
        local_weight: weight of this request's counts against the global matrix's.
        min_prob: continuations below this tri-gram probability are not drafted.
    """

    name = "aded"

    def __init__(self, c_puct: float = 1.0, top_k: int = 8, max_depth: int = 8, local_weight: float = 4.0,
                 min_prob: float = 0.0):
        if not c_puct >= 0:
            raise ValueError(f"aded: c_puct must be >= 0, got {c_puct}")
        if not (isinstance(top_k, int) and top_k >= 1) or not (isinstance(max_depth, int) and max_depth >= 1):
            raise ValueError("aded: top_k and max_depth must be integers >= 1")
        if not local_weight >= 0 or not 0 <= min_prob < 1:
            raise ValueError("aded: need local_weight >= 0 and 0 <= min_prob < 1")
        self.c_puct, self.top_k, self.max_depth = c_puct, top_k, max_depth
        self.local_weight, self.min_prob = local_weight, min_prob
        # the global matrix, shared by forks and kept across requests
        self.global_tri: dict[tuple[int, int], Counts] = {}
        self.global_bi: dict[int, Counts] = {}
        # P(a drafted token is the target's next token | its features), shared by forks and requests
        self.rates = HitRates(prior=_prior)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.local_tri: dict[tuple[int, int], Counts] = {}
        self.local_bi: dict[int, Counts] = {}
        self.counted = 1  # tokens[i] for i < counted are in the local matrix as continuations
        self._learn(list(prompt_ids))

    # -- the matrix ------------------------------------------------------------------------------

    def _learn(self, tokens: list[int]) -> None:
        """Count every continuation ``tokens[i]``, ``counted <= i < len(tokens)``, in the local matrix."""
        for i in range(max(self.counted, 1), len(tokens)):
            _count(self.local_bi, tokens[i - 1], tokens[i])
            if i >= 2:
                _count(self.local_tri, (tokens[i - 2], tokens[i - 1]), tokens[i])
        self.counted = max(self.counted, len(tokens))

    def distribution(self, a: int, b: int) -> list[tuple[int, float]]:
        """``[(c, P(c | a, b))]``: the ``top_k`` likeliest continuations of the pair, best first (ties:
        the smaller token), backing off to ``b``'s bigram row when the pair was never seen."""
        return self._candidates(a, b)[0]

    def _candidates(self, a: int, b: int) -> tuple[list[tuple[int, float]], list[Key]]:
        """:meth:`distribution` and each continuation's calibration key."""
        for order, local, shared in ((3, self.local_tri.get((a, b)), self.global_tri.get((a, b))),
                                     (2, self.local_bi.get(b), self.global_bi.get(b))):
            if local or shared:
                return self._row(order, local or {}, shared or {})
        return [], []

    def _row(self, order: int, local: Counts, shared: Counts) -> tuple[list[tuple[int, float]], list[Key]]:
        weights = {c: self.local_weight * n for c, n in local.items()}
        for c, n in shared.items():
            weights[c] = weights.get(c, 0.0) + n
        total = sum(weights.values())
        if total <= 0:
            return [], []
        evidence = _evidence_bucket(sum(local.values()) + sum(shared.values()))
        best = sorted(weights.items(), key=lambda cw: (-cw[1], cw[0]))[:self.top_k]
        row = [(c, w / total) for c, w in best if w / total >= self.min_prob and w > 0]
        return row, [(order, _decile(p), evidence) for _, p in row]

    def finish(self, tokens: list[int]) -> None:
        """Merge this request's counts into the global matrix (what later requests start from)."""
        self._learn(tokens)
        for key, row in self.local_tri.items():
            for c, n in row.items():
                _count(self.global_tri, key, c, n)
        for key, row in self.local_bi.items():
            for c, n in row.items():
                _count(self.global_bi, key, c, n)
        self.local_tri, self.local_bi = {}, {}

    # -- the search ------------------------------------------------------------------------------

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        self._learn(tokens)
        if budget <= 0:
            return DraftTree()
        prev = tokens[-2] if len(tokens) > 1 else -1
        root = _Node(tokens[-1], -1, (prev, tokens[-1]), 1.0, 1.0, 0)
        out_tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        tags: list[tuple[str, Key]] = []
        # each iteration adds at most one node; a dead end (no continuation) adds none, and marks it
        for _ in range(2 * budget + 8):
            if len(out_tokens) >= budget or root.exhausted:
                break
            self._iterate(root, out_tokens, parents, scores, tags)
        return DraftTree(out_tokens, parents, None, scores, tags)

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        """Record which verified nodes were the target's next token (the calibration of the scores)."""
        if logits is not None and len(tree):
            record_tree(self.rates, SOURCE, tree, logits, acceptance)

    def _iterate(self, root: _Node, out_tokens: list[int], parents: list[int], scores: list[float],
                 tags: list) -> None:
        """One MCTS iteration: select by PUCT down to an unexpanded continuation, add it, back up its value."""
        path = [root]
        node = root
        while True:
            if node.candidates is None:
                node.candidates, node.keys = self._candidates(*node.context) if node.depth < self.max_depth \
                    else ([], [])
            choice = self._select(node)
            if choice is None:  # nothing to add below this node
                node.exhausted = True
                value = 0.0
                break
            token, prior, rank = choice
            child = node.children.get(token)
            if child is None:
                key = node.keys[rank]
                child = _Node(token, len(out_tokens), (node.context[1], token), node.path_prob * prior,
                              node.score * self.rates.p(key), node.depth + 1)
                node.children[token] = child
                out_tokens.append(token)
                parents.append(node.index)
                scores.append(child.score)
                tags.append((SOURCE, key))
                path.append(child)
                value = child.path_prob
                break
            node = child
            path.append(node)
        for n in path:
            n.visits += 1
            n.value_sum += value
        # a parent is exhausted once all its children are; a node left open keeps its ancestors open,
        # so the walk up stops there (only a dead end can close anything)
        for n in reversed(path[:-1]):
            if not (n.candidates is not None and len(n.children) == len(n.candidates)
                    and all(ch.exhausted for ch in n.children.values())):
                break
            n.exhausted = True

    def _select(self, node: _Node) -> tuple[int, float, int] | None:
        """``(token, P, rank)``: the continuation of ``node`` with the largest PUCT value (not
        exhausted), or None."""
        explore = self.c_puct * math.sqrt(max(node.visits, 1))
        best, best_value = -1, -math.inf
        children = node.children
        for rank, (token, prior) in enumerate(node.candidates):
            child = children.get(token)
            if child is None:
                value = explore * prior  # Q = 0, N = 0
            elif child.exhausted:
                continue
            else:
                value = child.q + explore * prior / (1 + child.visits)
            if value > best_value:
                best, best_value = rank, value
        return None if best < 0 else (*node.candidates[best], best)
