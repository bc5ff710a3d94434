"""``hydra``: Hydra heads (Ankner et al. 2024): Medusa's heads reading the tokens drafted before them.

Head ``k`` (:mod:`speculum.heads.hydra`) reads the feature of the token before the root and the
embeddings of the root and the path drafted down to depth ``k - 1``, and predicts the token at depth
``k``. So, unlike ``medusa``, each branch gets its own continuation, and the tree grows as EAGLE-2's
dynamic tree (:mod:`speculum.drafting.tree_growth`): depth ``k`` expands the best nodes of depth
``k - 1`` in one call of head ``k``; with ``lookup``, after each depth the best path is looked up in
the text (:mod:`speculum.drafters.text_lookup`) and, where it occurred before, what followed it there
ends the draft. Sampled requests draft a chain, each token drawn from its
head's distribution q given the tokens drawn before it, q attached for the verifier.
"""

from __future__ import annotations

import torch

from ..drafting.tree_growth import DynamicTree
from ..tree import DraftTree
from .medusa import HeadDrafter
from .text_lookup import TextLookup


class HydraDrafter(TextLookup, HeadDrafter):
    name = kind = "hydra"

    def __init__(self, target, draft_head=None, top_k: int = 8, max_nodes: int = 48, min_path_prob: float = 0.02,
                 lookup: int = 8):
        super().__init__(target, draft_head, top_k, max_nodes)
        self.min_path_prob = min_path_prob
        self.init_lookup(lookup)

    def _logits(self, k: int, paths: list[list[int]]) -> torch.Tensor:
        """Head ``k``'s draft logits ``[m, K]`` for ``m`` paths (root first, ``k`` tokens each)."""
        embeds = self.tables.embeds(torch.tensor(paths, device=self.device))  # [m, k, D]
        return self.tables.logits(self.head.draft(k, self.feat, embeds)).float()

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        if not self.ready(tokens, budget):
            return DraftTree()
        root, depth = tokens[-1], min(self.depth, budget)
        if not self.params.greedy:
            path, qs = [root], []
            for k in range(1, depth + 1):
                q = self.q(self._logits(k, [path])[0])
                path.append(int(torch.multinomial(q, 1, generator=self.generator)))
                qs.append(q)
            return DraftTree.chain(path[1:], torch.stack(qs))
        grow = DynamicTree(self.top_k, self.min_path_prob, self.end_ids)
        room = min(self.max_nodes, budget)
        level = grow.add_children([-1], torch.log_softmax(self._logits(1, [[root]]), -1), self.tables.token_ids)
        grow.grow(level, depth - 1,  # expansion e runs head e + 1
                  lambda frontier, e: torch.log_softmax(self._logits(e + 1, [[root] + grow.path(i) for i in frontier]), -1),
                  self.tables.token_ids, lambda lv: self.look_up_under(grow, lv, tokens, room))
        return grow.result(room)
