"""``suffix_merged``: speculum's variant of SuffixDecoding (the paper's rule is ``suffix``).

The same two tries (:class:`~speculum.drafters.suffix.SuffixDrafter`'s), used differently:

- only the *longest* match of the context (up to ``max_match`` tokens) in each trie is grown,
  best-first by empirical continuation probability (a child's count over its siblings' total,
  multiplied down the path), at most ``max_spec_factor * match_length`` nodes;
- the trees of both tries are *merged* into one (a token both propose becomes one node);
- each node carries a calibrated score for the engine's tree sizer: the product of learnt hit
  rates keyed by (trie, length of the context match the node extends, empirical probability
  bucket, and whether the previous step accepted 4 or more tokens: hits along a verbatim copy are
  correlated, which a product of per-node rates misses).

It is the suffix source of ``mix`` and ``auto``: merging into a shared tree is what lets them
combine it with Token Recycling's candidates (:meth:`SuffixMergedDrafter.expand`).
"""

from __future__ import annotations

import bisect
import heapq
import math

from ..tree import DraftTree, TreeBuilder
from ..verify import Acceptance
from .hit_rates import HitRates, record_tree
from .suffix import SuffixDrafter
from .suffix_index import SuffixIndex

SOURCE = "suffix"
_BUCKETS = (1, 2, 3, 4, 6, 9, 14, 22)


def _length_bucket(length: int) -> int:
    """Match lengths 1, 2, 3, 4, 5-6, 7-9, 10-14, 15-22, 23+ -> 0..8."""
    return bisect.bisect_left(_BUCKETS, length)


def _prior(key) -> float:
    _trie, bucket, fbucket, _streak = key
    return min(0.9, (0.3 + 0.06 * bucket) * (fbucket + 0.5) / 4)


class SuffixMergedDrafter(SuffixDrafter):
    """Longest matches of both tries, merged, with calibrated scores.

    Args:
        max_depth: depth of the tries (pattern plus continuation).
        max_match: longest context suffix looked up.
        max_spec_factor: speculate at most ``max_spec_factor * match_length`` tokens per trie.
        min_token_prob: drop nodes whose empirical path probability is below this.
        max_nodes: most nodes per step.
        cache_requests: previous requests kept in the global trie (0 disables it).
    """

    name = "suffix_merged"

    def __init__(self, max_depth: int = 40, max_match: int = 16, max_spec_factor: float = 2.0,
                 min_token_prob: float = 0.1, max_nodes: int = 64, cache_requests: int = 256):
        super().__init__(max_depth, max_spec_factor, 0.0, min_token_prob, max_nodes, cache_requests)
        self.max_match = max_match
        self.rates = HitRates(prior=_prior)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.streak = 0

    def expand(self, builder: TreeBuilder, context: list[int], budget: int) -> None:
        """Add both tries' trees for ``context`` to ``builder``: at most ``budget`` new nodes in all."""
        self._sync(context)
        end = len(builder) + budget
        for name, index in (("local", self.local), ("global", self.global_index)):
            if len(index) > 1 and len(builder) < end:
                self._expand_from(builder, index, name, context, end)

    def _expand_from(self, builder: TreeBuilder, index: SuffixIndex, trie: str, context: list[int],
                     end: int) -> None:
        """Grow the tree of one trie's match until ``builder`` holds ``end`` nodes or the match's share."""
        node, m = index.longest_match(context, self.max_match)
        if m == 0:
            return
        limit = math.ceil(self.max_spec_factor * m)
        count, token = index.count, index.token
        # (-empirical path prob, tie, trie node, tree parent, parent score, token, cond, depth)
        heap: list = []
        tie = 0

        def push(tnode: int, prob: float, parent: int, parent_score: float, depth: int) -> None:
            nonlocal tie
            kids = index.children(tnode)
            total = sum(count[c] for c in kids)
            for c in kids:
                cond = count[c] / total
                if prob * cond >= self.min_token_prob:
                    tie += 1
                    heapq.heappush(heap, (-prob * cond, tie, c, parent, parent_score, token[c], cond, depth))

        push(node, 1.0, -1, 1.0, 1)
        added = 0
        while heap and added < limit and len(builder) < end:
            neg, _, tnode, parent, parent_score, tok, cond, depth = heapq.heappop(heap)
            # the context this node is predicted from matches the history over m + depth - 1 tokens
            key = (trie, _length_bucket(m + depth - 1), min(int(cond * 4), 3), self.streak)
            score = parent_score * self.rates.p(key)
            tree_node = builder.add(parent, tok, score, (SOURCE, key))
            added += 1
            push(tnode, -neg, tree_node, score, depth + 1)

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        builder = TreeBuilder()
        self.expand(builder, tokens, min(budget, self.max_nodes))
        return builder.build()

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if logits is not None:
            record_tree(self.rates, SOURCE, tree, logits, acceptance)
        # copying runs: after a step that accepted 4+ tokens the next draft is likelier to hold
        self.streak = int(len(acceptance.path) >= 4)
