"""Lookups in the text for drafters that grow a tree or chain with a model (self-drafters, learned heads).

After each drafted depth, the best path so far is looked up in the request's committed tokens,
prompt-lookup style (:meth:`~speculum.drafters.ngram.NgramDrafter.continuation`: its last 2-3
tokens, the drafted ones included). Where it occurred before, the ``lookup`` tokens that followed
it there hang under it (:meth:`~speculum.drafting.tree_growth.DynamicTree.add_path`, each scored
:data:`LOOKUP_PROB`) and the drafter stops drafting deeper: copied text (a quoted question, a needle's value, a summary's
phrases) costs one draft forward instead of one per token.

:class:`TextLookup` is a mixin: a drafter lists it before :class:`~speculum.drafters.base.Drafter`,
calls :meth:`~TextLookup.init_lookup` in its ``__init__`` and :meth:`~TextLookup.look_up_under` after
each depth; forking and resetting the text index come with the mixin.
"""

from __future__ import annotations

from ..drafting.tree_growth import DynamicTree
from ..errors import SpeculumError
from .ngram import NgramDrafter

# the acceptance a token looked up in the text is scored with, per token (for the engine's tree sizer)
LOOKUP_PROB = 0.7


class TextLookup:
    """Mixin: ``lookup`` tokens a drafted path may take from an earlier occurrence in the text (0: none)."""

    lookup: int = 0
    text: NgramDrafter | None = None  # the request's committed tokens, indexed by 2- and 3-grams

    def init_lookup(self, lookup: int) -> None:
        if lookup < 0:
            raise SpeculumError(f"lookup is a number of tokens >= 0, not {lookup}")
        self.lookup = lookup
        self.text = NgramDrafter(max_ngram=3, min_ngram=2) if lookup else None

    def fork(self):
        twin = super().fork()
        if self.text is not None:
            twin.text = self.text.fork()
        return twin

    def reset(self, prompt_ids, params, generator) -> None:
        super().reset(prompt_ids, params, generator)
        if self.text is not None:
            self.text.reset(prompt_ids, params, generator)

    def looked_up(self, tokens: list[int], chain: list[int], room: int) -> list[int]:
        """What followed an earlier occurrence of ``chain``'s end in ``tokens`` (``lookup`` tokens at
        most, within ``room`` nodes with ``chain``'s own), or ``[]``: also without a lookup or after
        an end token."""
        k = min(self.lookup, room - len(chain))
        if self.text is None or k <= 0 or chain[-1] in self.end_ids:
            return []
        return self.text.continuation(tokens, chain, k)

    def look_up_under(self, grow: DynamicTree, level: list[int], tokens: list[int], room: int) -> bool:
        """Whether the best path of ``level`` (the highest-scoring node's) occurred earlier in
        ``tokens``: then what followed it there is added under it (and the caller stops drafting
        deeper)."""
        if self.text is None or not level:
            return False
        best = max(level, key=lambda i: (grow.scores[i], -i))
        found = self.looked_up(tokens, grow.path(best), room)
        grow.add_path(best, found, LOOKUP_PROB)
        return bool(found)
