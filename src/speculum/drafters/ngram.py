"""``ngram``: prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

The last ``n`` tokens of the sequence are looked up among earlier ``n``-grams of the prompt and
the generated text; the tokens that followed the match are the draft. Example with ``n = 2``:
tokens ``[1, 2, 3, 4, 2, 3]`` end with ``(2, 3)``, which occurred before at positions 1-2 followed
by ``4, 2, 3``: the draft is ``[4, 2, 3]`` (as long as the draft length allows).

speculum's defaults differ from the original scan (the paper's setting is ``prefer="first",
adaptive=False, max_draft=10, unigram_draft=10``):

- An incremental index (``n``-gram -> position after its most recent occurrence), updated with
  each committed token, so a lookup costs O(max_n) dict probes instead of a scan of the whole
  sequence every step.
- Longest ``n`` first, and among occurrences of the same ``n``-gram the most recent one: recent
  text is the best predictor of what is being copied right now.
- Adaptive draft length: drafting grows by ``grow`` tokens while whole drafts are accepted and
  falls back to ``accepted + grow`` after a rejection, within ``[min_draft, max_draft]``. A
  one-token match (``n = 1``) is weak evidence, so its draft is capped at ``unigram_draft``.
  The defaults (16 / 6 / 4 / 8) were tuned on the development prompts (BENCHMARKS.md, "Why the
  defaults").
- ``prefer="first"`` takes the earliest occurrence instead (as transformers does); ``per_ngram``
  caps the draft at ``per_ngram * n`` tokens for an ``n``-token match.
- ``scored=True`` (``auto``'s ``ngram`` arm) attaches to each drafted node a score for the engine's
  tree sizer: the product down the chain of learnt hit rates keyed by (match length ``n``, depth,
  whether the previous step accepted 4 or more tokens), as ``suffix_merged`` scores its nodes. Where
  every verified row costs (a CPU) the sizer then keeps only the part of a chain likely to pay; a
  long verbatim copy, whose hit rates are high, keeps its length.
- ``branches > 1`` (the ``ngram_tree`` method) drafts a tree: the continuations of up to
  ``branches`` occurrences with different next tokens, longest n-gram first, the preferred one
  ``draft_len`` long and the others ``branch_draft`` long, merged where they share a prefix.
"""

from __future__ import annotations

from ..tree import DraftTree, TreeBuilder
from ..verify import Acceptance
from .base import Drafter
from .hit_rates import HitRates, record_tree

SOURCE = "ngram"


def _prior(key) -> float:
    """Before any evidence: longer matches and copying runs hit more often, deeper nodes less."""
    n, depth, streak = key
    return min(0.9, (0.3 + 0.15 * (n - 1) + 0.3 * streak) * 0.9 ** (depth - 1))


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 16, min_draft: int = 6,
                 grow: int = 4, unigram_draft: int = 8, adaptive: bool = True, prefer: str = "recent",
                 per_ngram: float = 0.0, branches: int = 1, branch_draft: int = 4, scored: bool = False):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if not 1 <= min_draft <= max_draft:
            raise ValueError("need 1 <= min_draft <= max_draft")
        self.sizes = list(range(max_ngram, min_ngram - 1, -1))
        self.max_draft, self.min_draft, self.grow = max_draft, min_draft, grow
        self.unigram_draft, self.adaptive = unigram_draft, adaptive
        if prefer not in ("recent", "first"):
            raise ValueError("prefer must be 'recent' or 'first'")
        self.prefer, self.per_ngram = prefer, per_ngram
        if branches < 1:
            raise ValueError("branches must be >= 1")
        self.branches, self.branch_draft = branches, branch_draft
        if scored and branches > 1:
            raise ValueError("scored chains only: scored=True needs branches=1")
        self.rates = HitRates(prior=_prior) if scored else None  # kept across requests

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        # for trees: n-gram -> every continuation start, oldest first
        self.all_starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}
        self.indexed = 0  # continuation starts < indexed are in the index
        self.draft_len = self.max_draft
        self.streak = 0  # whether the previous step accepted 4 or more tokens (scored chains)

    def _index_upto(self, tokens: list[int]) -> None:
        """Index every n-gram whose continuation start ``i`` satisfies ``indexed <= i < len(tokens)``."""
        for i in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if i >= n:
                    key = tuple(tokens[i - n:i])
                    if self.prefer == "recent":
                        self.index[n][key] = i
                    else:
                        self.index[n].setdefault(key, i)
                    if self.branches > 1:
                        self.all_starts[n].setdefault(key, []).append(i)
        self.indexed = len(tokens)

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        # The suffix n-gram itself ends at len(tokens); it is indexed only once a token follows it,
        # so a lookup finds an earlier occurrence.
        self._index_upto(tokens)
        match = self._match(tokens)
        if match is None:
            return DraftTree()
        n, start = match
        k = self.draft_len if n > 1 else min(self.draft_len, self.unigram_draft)
        if self.per_ngram:
            k = min(k, max(self.min_draft, int(self.per_ngram * n)))
        k = min(k, budget)
        if self.branches > 1:
            return self._tree(tokens, n, start, k, budget)
        if self.rates is not None:
            return self._scored_chain(tokens[start:start + k], n)
        return DraftTree.chain(tokens[start:start + k])

    def _scored_chain(self, chain: list[int], n: int) -> DraftTree:
        """``chain`` with each node scored by the hit rates down to it (see the module doc)."""
        builder, parent, score = TreeBuilder(), -1, 1.0
        for depth, tok in enumerate(chain, start=1):
            key = (n, min(depth, 8), self.streak)
            score *= self.rates.p(key)
            parent = builder.add(parent, tok, score, (SOURCE, key))
        return builder.build()

    def _match(self, ends: list[int]) -> tuple[int, int] | None:
        """``(n, start)``: the longest indexed n-gram ending ``ends`` and where its continuation
        starts (its preferred occurrence), or None."""
        for n in self.sizes:
            if n <= len(ends):
                start = self.index[n].get(tuple(ends[len(ends) - n:]))
                if start is not None:
                    return n, start
        return None

    def continuation(self, tokens: list[int], tail: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest n-gram
        ending ``tokens + tail`` (``tail``: tokens drafted past the committed ``tokens``, not indexed),
        or ``[]``. Only ``tokens`` are searched. Example (``sizes`` 3..2): ``tokens`` ``[5, 6, 7, 8, 5]``
        and ``tail`` ``[6]`` end with ``(5, 6)``, which was followed by ``7, 8, 5``."""
        self._index_upto(tokens)
        match = self._match(tokens[max(0, len(tokens) - self.sizes[0]):] + tail)
        return tokens[match[1]:match[1] + k] if match is not None else []

    def _tree(self, tokens: list[int], n_first: int, start: int, k: int, budget: int) -> DraftTree:
        """The preferred continuation plus other occurrences' continuations with different next tokens."""
        builder = TreeBuilder()
        builder.add_path(tokens[start:start + k], [1.0] * k)
        firsts = {tokens[start]} if start < len(tokens) else set()
        length = len(tokens)
        for n in self.sizes:
            if n > n_first or n > length or len(firsts) >= self.branches:
                continue
            starts = self.all_starts[n].get(tuple(tokens[length - n:]), [])
            order = reversed(starts) if self.prefer == "recent" else iter(starts)
            for s in order:
                if len(firsts) >= self.branches or len(builder) >= budget:
                    break
                if s >= length or tokens[s] in firsts:
                    continue
                firsts.add(tokens[s])
                room = min(self.branch_draft, budget - len(builder))
                builder.add_path(tokens[s:s + room], [1.0] * room)
        tree = builder.build()
        return DraftTree(tree.tokens, tree.parents)

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if self.rates is not None:
            if logits is not None:
                record_tree(self.rates, SOURCE, tree, logits, acceptance)
            self.streak = int(len(acceptance.path) >= 4)
        if not self.adaptive or len(tree) == 0:
            return
        accepted = len(acceptance.path)
        if accepted == (len(tree) if tree.is_chain else max(tree.depths())):
            self.draft_len = min(self.max_draft, self.draft_len + self.grow)
        else:
            self.draft_len = max(self.min_draft, min(self.max_draft, accepted + self.grow))
