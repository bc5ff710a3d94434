"""``stand``: STAND, STochastic Adaptive N-gram Drafting (Song et al. 2025, "Accelerated Test-Time
Scaling with Model-Free Speculative Sampling", https://arxiv.org/abs/2506.04708).

The rule: an n-gram table whose entries are not the tokens that followed an n-gram but the
*target's distributions* seen after it. Each verification computes the target's distribution after
every committed token; STAND keeps its ``top_k`` probabilities under the n-grams (``n = 1 ..
max_ngram``) that end there, merged with what was stored before. Drafting looks up the longest
n-gram ending the path and so has a real draft distribution q: under sampling the draft tokens are
*sampled* from q and the tree carries q, so speculative sampling accepts x with probability
``min(1, p(x) / q(x))``, far more often than the ``p(x)`` a point-mass draft gets when p is spread.
Siblings are drawn by Gumbel-top-k: perturb ``log q`` with Gumbel noise and take the ``w`` largest,
which is sampling ``w`` tokens without replacement.

Exactness of sampled trees. :meth:`~speculum.verify.Verifier.accept_sampled` tries a node's children
in order, accepting child ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))`` and moving to the
residual ``p_{i+1} = norm(max(0, p_i - q_i))`` on rejection, ``q_i`` being the child's row of
``draft_probs``. That is exact when each ``q_i`` is the distribution ``x_i`` was really drawn from
given the earlier siblings. For i.i.d. siblings (SpecInfer) every ``q_i`` is q; for siblings drawn
without replacement, ``q_i`` is q with ``x_1 .. x_{i-1}`` removed and renormalized, and the same loop is
then Recursive Speculative Decoding's sampling-without-replacement verification (Jeon et al. 2024,
https://arxiv.org/abs/2402.14160). STAND therefore stores each sibling's *conditional* q in
``draft_probs`` (Gumbel-top-k order is the sequential sampling order) and the verifier needs no
change; storing the unconditional q for every sibling is the with-replacement rule applied to draws
without replacement, and ``tests/test_draft_modelfree.py`` shows a chi-square test rejects it. How
many children a node gets depends only on its depth and on the budget left, never on the tokens
drawn, so the tree's shape does not bias the draws.

Greedy (temperature 0): nothing is sampled; a node's children are the ``w`` likeliest tokens of the
stored distribution (the first is its argmax), drafts are point masses and the greedy walk keeps
the output equal to plain greedy decoding's.

Where no target distribution was seen yet for an n-gram (the prompt's n-grams: prefill returns no
distributions), its entry holds the counts of the tokens that followed it, a one-hot per
occurrence, so the prompt's n-grams draft too. The table is kept across requests (the paper's
setting: many samples of one problem share it).

speculum's reading where the paper leaves a choice (the reference code was not available here):
stored distributions are merged by summing their ``top_k`` probabilities (a running mean), pruned to
``2 * top_k`` tokens; the tree is grown best-first by the product of q along the path with
``widths[d]`` children at depth ``d + 1`` (the paper fits a static tree shape offline to its models;
these widths are an option). The defaults (``max_ngram = 4``, ``top_k = 8``, ``widths = (3, 2, 2, 1)``,
``max_depth = 10``, 24 nodes per step from the registry) are speculum's.

Sizing (speculum's addition, not the paper's). Greedy trees carry a *calibrated* score per node for
the engine's tree sizer (:class:`~speculum.tree_sizing.TreeSizer`): the parent's score times the
learnt rate at which tokens drafted with the same features were the target's next token
(:class:`~speculum.drafters.hit_rates.HitRates`, shared across requests); the features are the
length of the n-gram that matched, the decile of the token's q and how much the n-gram's entry
holds (one observation, 2-3, 4-10, more). Before any observation a key's rate is its decile's
midpoint. The sizer then keeps the prefix of nodes worth their rows on this hardware. Sampled
trees carry no scores and are verified whole: the sizer keeps nodes by score, and a score that
depends on the drawn token would make a node's presence depend on its own draw, which biases
the draws the verifier corrects with ``q``.

Example (``top_k = 3``, ``widths = (2, 1)``): after ``... the cat`` the target gave ``sat 0.6, ran 0.3,
is 0.1``, after ``cat sat`` ``on 0.9, down 0.1`` and after ``cat ran`` ``away 1.0``. Greedy drafts ``sat`` and
``ran`` below the root, ``on`` below ``sat`` and ``away`` below ``ran``. Sampling may draw ``ran`` then ``sat``
(Gumbel-top-2): ``ran`` carries q ``(sat 0.6, ran 0.3, is 0.1)`` and ``sat`` carries ``(sat 0.6 / 0.7, is
0.1 / 0.7)``.
"""

from __future__ import annotations

import heapq
import math
import random

import torch

from ..tree import DraftTree
from ..verify import Acceptance
from .base import Drafter
from .hit_rates import HitRates, record_tree

Dist = list[tuple[int, float]]  # [(token, probability)] best first, probabilities summing to 1
SOURCE = "stand"


def _mass_bucket(mass: float) -> int:
    """Bucket of a table entry's summed probability (about its observation count): 0 up to 1,
    1 up to 3, 2 up to 10, 3 above."""
    return 0 if mass <= 1.0 + 1e-6 else 1 if mass <= 3.0 + 1e-6 else 2 if mass <= 10.0 + 1e-6 else 3


def _decile(p: float) -> int:
    """``p``'s decile, 0-9 (a value a rounding error below a boundary counts as on it)."""
    return min(int(p * 10 + 1e-6), 9)


def _prior(key: tuple[int, int, int]) -> float:
    """A key ``(n-gram length, decile of q, mass bucket)``'s hit rate before any observation: the
    midpoint of its decile."""
    return (key[1] + 0.5) / 10


class StandDrafter(Drafter):
    """STAND: n-grams that remember the target's distributions; sampled, without-replacement trees.

    Args:
        max_ngram: longest n-gram looked up (all of ``1 .. max_ngram`` are stored).
        top_k: probabilities kept per stored distribution (a draft distribution's support).
        widths: children per node at depth ``1, 2, ...`` (the last repeats).
        max_depth: deepest node drafted.
    """

    name = "stand"

    def __init__(self, max_ngram: int = 4, top_k: int = 8, widths: tuple[int, ...] = (3, 2, 2, 1),
                 max_depth: int = 10):
        if not (isinstance(max_ngram, int) and max_ngram >= 1) or not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError("stand: max_ngram and top_k must be integers >= 1")
        if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"stand: widths must be integers >= 1, got {widths}")
        if not (isinstance(max_depth, int) and max_depth >= 1):
            raise ValueError(f"stand: max_depth must be an integer >= 1, got {max_depth}")
        self.sizes = list(range(max_ngram, 0, -1))
        self.top_k, self.widths = top_k, tuple(widths)
        self.max_depth = max_depth
        # n-gram -> {next token: summed probability}, shared by forks and kept across requests
        self.table: dict[tuple[int, ...], dict[int, float]] = {}
        self.vocab: int | None = None  # the logits' width, once seen
        # P(a greedy draft is the target's next token | its features), shared by forks and requests
        self.rates = HitRates(prior=_prior)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self._buffer: torch.Tensor | None = None  # [rows, V] this request's draft_probs (see _dense)
        self._written: tuple[torch.Tensor, torch.Tensor] | None = None
        prompt = list(prompt_ids)
        for i in range(1, len(prompt)):
            self._store(prompt[:i], {prompt[i]: 1.0})

    # -- the table -------------------------------------------------------------------------------

    def _store(self, context: list[int], dist: dict[int, float]) -> None:
        """Merge ``dist`` (what followed ``context``) into the entries of every n-gram ending ``context``."""
        for n in self.sizes:
            if n > len(context):
                continue
            key = tuple(context[len(context) - n:])
            entry = self.table.get(key)
            if entry is None:
                self.table[key] = dict(dist)
                continue
            for tok, p in dist.items():
                entry[tok] = entry.get(tok, 0.0) + p
            if len(entry) > 2 * self.top_k:
                kept = sorted(entry.items(), key=lambda tp: -tp[1])[:2 * self.top_k]
                entry.clear()
                entry.update(kept)

    def lookup(self, context: list[int]) -> Dist:
        """The draft distribution after ``context``: the stored one of the longest n-gram ending it,
        its ``top_k`` tokens renormalized (ties: the smaller token), or ``[]``."""
        return self._lookup(context)[0]

    def _lookup(self, context: list[int]) -> tuple[Dist, int, float]:
        """:meth:`lookup`, the length of the n-gram that matched and its entry's summed probability."""
        for n in self.sizes:
            if n <= len(context):
                entry = self.table.get(tuple(context[len(context) - n:]))
                if entry:
                    best = sorted(entry.items(), key=lambda tp: (-tp[1], tp[0]))[:self.top_k]
                    total = sum(p for _, p in best)
                    return [(t, p / total) for t, p in best if p > 0], n, sum(entry.values())
        return [], 0, 0.0

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits: torch.Tensor) -> None:
        """Store the target's distributions of the root's and the accepted nodes' rows under the
        committed text that precedes each, and record which scored nodes were the target's next token."""
        self.vocab = logits.shape[-1]
        if tree.scores is not None:
            record_tree(self.rates, SOURCE, tree, logits, acceptance)
        start = len(tokens) - len(acceptance.tokens)  # the root is tokens[start - 1]
        if start < 1 or tokens[start:] != acceptance.tokens:
            return  # a grammar rewrote the step's tokens: the rows no longer match the text
        rows = torch.tensor([0] + [i + 1 for i in acceptance.path], device=logits.device)
        probs = self._target_probs(logits.index_select(0, rows))  # [m, V]
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        for j, (toks, ps) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            total = sum(ps)
            if total > 0:
                self._store(tokens[max(0, start + j - self.sizes[0]):start + j],
                            {t: p / total for t, p in zip(toks, ps) if p > 0})

    def _target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[m, V]`` the target's distribution to remember: the sampling one (temperature, top-k,
        top-p), or under greedy decoding the softmax, whose order is what greedy drafting needs."""
        if self.params.greedy:
            return torch.softmax(logits.float(), dim=-1)
        return self.params.probs(logits)

    # -- drafting --------------------------------------------------------------------------------

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        sampled = not self.params.greedy and self.vocab is not None
        rng = random.Random(int(torch.randint(0, 1 << 62, (), generator=self.generator))) if sampled else None
        tail = tokens[len(tokens) - self.sizes[0]:] if len(tokens) > self.sizes[0] else list(tokens)
        out, parents = [], []
        qs: list[Dist] = []  # each node's conditional draft distribution (sampled trees)
        paths: list[list[int]] = []
        scores: list[float] = []  # greedy trees: calibrated acceptance estimates (see the module doc)
        tags: list = []
        heap = [(-1.0, -1, 0)]  # (-path probability, node (-1: the root), depth of the node)
        while heap and len(out) < budget:
            neg, node, depth = heapq.heappop(heap)
            path = paths[node] if node >= 0 else []
            dist, n, mass = self._lookup(tail + path)
            if not dist:
                continue
            # how many children: fixed by the depth and the room left, never by the tokens drawn
            width = min(self.widths[min(depth, len(self.widths) - 1)], len(dist), budget - len(out))
            picks = gumbel_top_k(dist, width, rng) if sampled else [(t, p, dist) for t, p in dist[:width]]
            parent_score = scores[node] if node >= 0 and not sampled else 1.0
            for tok, prob, q in picks:
                out.append(tok)
                parents.append(node)
                qs.append(q)
                paths.append(path + [tok])
                if not sampled:
                    key = (n, _decile(prob), _mass_bucket(mass))
                    scores.append(parent_score * self.rates.p(key))
                    tags.append((SOURCE, key))
                if depth + 1 < self.max_depth:
                    heapq.heappush(heap, (neg * prob, len(out) - 1, depth + 1))
        if sampled:
            return DraftTree(out, parents, self._dense(qs) if out else None)
        return DraftTree(out, parents, None, scores, tags)

    def _dense(self, qs: list[Dist]) -> torch.Tensor:
        """``[n, V]`` float32 rows of the sparse distributions ``qs``: a view of this request's buffer
        (a fresh ``[n, V]`` allocation costs more than the drafting itself), valid until the next
        :meth:`propose`, by which time the step that verified it is over."""
        rows = torch.tensor([i for i, q in enumerate(qs) for _ in q])
        cols = torch.tensor([t for q in qs for t, _ in q])
        if self._buffer is None or self._buffer.shape[0] < len(qs) or self._buffer.shape[1] != self.vocab:
            self._buffer = torch.zeros(max(len(qs), 32), self.vocab)
        else:
            self._buffer[self._written] = 0.0  # clear the last tree's entries only
        self._buffer[rows, cols] = torch.tensor([p for q in qs for _, p in q])
        self._written = (rows, cols)
        return self._buffer[:len(qs)]


def gumbel_top_k(dist: Dist, k: int, rng: random.Random) -> list[tuple[int, float, Dist]]:
    """``k`` tokens of ``dist`` sampled without replacement (Gumbel-top-k: the ``k`` largest ``log p +
    Gumbel`` keys, in sampling order), each as ``(token, p, q)`` with ``q`` the distribution it was
    drawn from given the earlier ones: ``dist`` without them, renormalized."""
    keys = [(math.log(p) - math.log(-math.log(rng.random() or 5e-324)), t, p) for t, p in dist]
    chosen = heapq.nlargest(k, keys)
    out, removed = [], 0.0
    taken: set[int] = set()
    for _, tok, p in chosen:
        left = 1.0 - removed
        q = [(t, pt / left) for t, pt in dist if t not in taken]
        out.append((tok, p, q))
        taken.add(tok)
        removed += p
    return out
