"""``suffix``: SuffixDecoding (Oliaro et al. 2024), the paper's rule.

Two :class:`~speculum.drafters.suffix_index.SuffixIndex` tries: a *local* one over this request's
prompt and output, updated as tokens are committed, and a *global* one over the outputs of
previous requests (bounded: the oldest request is evicted past ``cache_requests``), so repeated
workloads get faster over time.

Each step, in each trie, every match length ``m = 1, 2, ...`` (the context's last ``m`` tokens
occurred before) gets its own candidate tree, grown best-first by empirical path probability (a
child's probability is its parent's times ``count(child) / count(parent)``), keeping nodes whose
probability is at least ``min_token_prob`` and at most ``max_spec_factor * m + max_spec_offset``
of them: a long match earns a long speculation. A tree's score is the sum of its nodes'
probabilities, its expected number of accepted tokens; the best-scoring tree of each trie is kept
(ties: the longer match), and of the two the better one (ties: the local one). Lengths stop at the
first that does not occur, since no longer one can.

Example: the context is ``b c d b c d b c e a b c``. For ``m = 1`` (``c``: seen 4 times, followed by
``d`` twice, ``e`` once, and once at the end) the budget is 1 and the tree ``d`` (0.5), score 0.5.
For ``m = 2`` (``b c``, the same 4 times) the budget is 2 and the tree ``d`` (0.5) with ``b`` below it
(0.5: ``b c d`` was followed by ``b`` both times), score 1.0. ``a b c`` occurred only at the end (no
continuation, score 0), and so did every longer suffix: the ``m = 2`` tree is drafted.

Each node's probability is also its score for the engine's tree sizer. Speculum's own variant,
which grows only the longest match with calibrated scores and merges both tries into one tree,
is ``suffix_merged`` (:mod:`.suffix_merged`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass

from ..tree import DraftTree
from .base import Drafter
from .suffix_index import SuffixIndex


@dataclass
class Candidate:
    """One match length's speculation tree (nodes in creation order, parents first)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]  # empirical path probability of each node

    @property
    def score(self) -> float:
        """Expected accepted tokens under the tries' frequencies."""
        return sum(self.probs)

    def tree(self) -> DraftTree:
        return DraftTree(self.tokens, self.parents, None, list(self.probs))


class SuffixDrafter(Drafter):
    """SuffixDecoding with the paper's defaults.

    Args:
        max_depth: depth of the tries (pattern plus continuation); matches are shorter.
        max_spec_factor, max_spec_offset: speculate at most ``factor * m + offset`` tokens for a
            match of ``m`` tokens.
        min_token_prob: drop nodes whose empirical path probability is below this.
        max_nodes: most nodes per step (and never more than the engine's budget).
        cache_requests: previous requests kept in the global trie (0 disables it).
    """

    name = "suffix"

    def __init__(self, max_depth: int = 64, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_nodes: int = 64, cache_requests: int = 256):
        self.max_depth = max_depth
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.min_token_prob, self.max_nodes = min_token_prob, max_nodes
        self.cache_requests = cache_requests
        self.global_index = SuffixIndex(max_depth)
        self.global_ids: deque[int] = deque()
        self.ids = itertools.count()  # request ids in the global trie (shared by forks)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.local = SuffixIndex(self.max_depth)
        self.local.extend(0, list(prompt_ids))
        self.seen = len(prompt_ids)
        self.prompt_len = len(prompt_ids)

    def _sync(self, tokens: list[int]) -> None:
        """Add the newly committed tokens to the local trie."""
        if len(tokens) > self.seen:
            self.local.extend(0, tokens[self.seen:])
            self.seen = len(tokens)

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        self._sync(tokens)
        limit = min(budget, self.max_nodes)
        local = self.best_candidate(self.local, tokens, limit)
        remote = self.best_candidate(self.global_index, tokens, limit)
        best = remote if local is None or (remote is not None and remote.score > local.score) else local
        return best.tree() if best is not None else DraftTree()

    def best_candidate(self, index: SuffixIndex, context: list[int], limit: int) -> Candidate | None:
        """The best-scoring match length's tree in ``index`` (None when the trie is empty or nothing matches)."""
        if len(index) <= 1 or limit <= 0:
            return None
        best = None
        for m in range(1, min(len(context), self.max_depth)):
            node = index.walk(context[len(context) - m:])
            if node is None:
                break
            size = min(limit, int(m * self.max_spec_factor + self.max_spec_offset + 1e-6))
            cand = self._grow(index, node, size)
            if best is None or cand.score >= best.score:
                best = cand
        return best

    def _grow(self, index: SuffixIndex, node: int, size: int) -> Candidate:
        """Up to ``size`` nodes below trie node ``node``, most probable first."""
        out = Candidate([], [], [])
        heap: list = []  # (-path probability, tie, trie node, tree parent)
        count, token = index.count, index.token

        def push(tnode: int, prob: float, parent: int) -> None:
            for c in index.children(tnode):
                p = prob * count[c] / count[tnode]
                if p >= self.min_token_prob:
                    heapq.heappush(heap, (-p, c, c, parent))

        push(node, 1.0, -1)
        while heap and len(out.tokens) < size:
            neg, _, tnode, parent = heapq.heappop(heap)
            out.tokens.append(token[tnode])
            out.parents.append(parent)
            out.probs.append(-neg)
            push(tnode, -neg, len(out.tokens) - 1)
        return out

    def finish(self, tokens: list[int]) -> None:
        """Add this request's output to the global trie; evict the oldest beyond ``cache_requests``."""
        if self.cache_requests <= 0:
            return
        output = tokens[self.prompt_len:]
        if not output:
            return
        rid = next(self.ids)
        self.global_index.extend(rid, output)
        self.global_ids.append(rid)
        while len(self.global_ids) > self.cache_requests:
            self.global_index.remove(self.global_ids.popleft())
