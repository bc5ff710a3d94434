"""``mix``: one draft tree merged from several sources (SAM-Decoding, RASD style).

Each source grows its candidates into a shared :class:`~speculum.tree.TreeBuilder`: a token two
sources both propose becomes one node with the larger score, and the engine's
:class:`~speculum.tree_sizing.TreeSizer` keeps the best-scoring nodes across all sources. With
``suffix`` and ``recycling`` (the default), long suffix matches dominate where text is being
copied and Token Recycling's adjacency candidates fill in where the suffix tries have nothing.

A source is any drafter with ``expand(builder, tokens, budget)``.
"""

from __future__ import annotations

from ..tree import DraftTree, TreeBuilder
from ..verify import Acceptance
from .base import Drafter


class MixDrafter(Drafter):
    name = "mix"

    def __init__(self, sources: list[Drafter], max_nodes: int = 64):
        if not sources or not all(hasattr(s, "expand") for s in sources):
            raise ValueError("mix needs sources with an expand(builder, tokens, budget) method")
        self.sources, self.max_nodes = sources, max_nodes

    def fork(self) -> MixDrafter:
        twin = super().fork()
        twin.sources = [s.fork() for s in self.sources]
        return twin

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        for s in self.sources:
            s.end_ids = self.end_ids
            s.reset(prompt_ids, params, generator)

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        builder = TreeBuilder()
        budget = min(budget, self.max_nodes)
        for s in self.sources:
            s.expand(builder, tokens, budget - len(builder))
        return builder.build()

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        for s in self.sources:
            s.update(tokens, tree, acceptance, logits)

    def finish(self, tokens: list[int]) -> None:
        for s in self.sources:
            s.finish(tokens)
