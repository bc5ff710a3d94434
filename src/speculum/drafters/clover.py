"""``clover``: Clover heads (Xiao et al. 2024, "Clover: Regressive Lightweight Speculative Decoding
with Sequential Knowledge", https://arxiv.org/abs/2405.00263): Medusa-style heads made sequential by
a regressive attention decoder over the context.

The head (:mod:`speculum.heads.clover`) keeps, per request, the augmented context of every token
the target cached (its final features, handed over after each step through :meth:`see_hidden`,
the prompt's after prefill). A step starts from the state ``s_0`` of the token before the root;
feeding the root gives ``s_1`` and head 1's draft of depth 1; feeding a drafted node's token to its
parent's state gives the node's state and the next head's draft below it. The tree grows as
EAGLE-2's dynamic tree (:mod:`speculum.drafting.tree_growth`): each depth expands its best nodes
in one decoder call; with ``lookup``, after each depth the best path is looked up in the text
(:mod:`speculum.drafters.text_lookup`). Sampled requests draft a chain, each token drawn from its
head's distribution q given the tokens drawn before it, q attached for the verifier.

Shapes: ``D`` hidden size, ``m`` nodes expanded at once, ``K`` the draft vocabulary.
"""

from __future__ import annotations

import torch

from ..drafting.tree_growth import DynamicTree
from ..heads.clover import CloverContext
from ..tree import DraftTree
from .medusa import HeadDrafter
from .text_lookup import TextLookup


class CloverDrafter(TextLookup, HeadDrafter):
    name = kind = "clover"

    def __init__(self, target, draft_head=None, top_k: int = 8, max_nodes: int = 48, min_path_prob: float = 0.02,
                 lookup: int = 8):
        super().__init__(target, draft_head, top_k, max_nodes)
        self.min_path_prob = min_path_prob
        self.init_lookup(lookup)

    def reset(self, prompt_ids, params, generator) -> None:
        super().reset(prompt_ids, params, generator)
        self.context = CloverContext(self.head)

    @torch.inference_mode()
    def see_hidden(self, hidden: dict[int, torch.Tensor]) -> None:
        super().see_hidden(hidden)
        self.context.extend(hidden[self.hidden_layers[0]].to(self.tables.embed.dtype))

    def _states(self, nodes: list[int], grow: DynamicTree, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The decoder states ``[m, D]`` of ``nodes``: each its parent's state stepped with its token
        (parents missing, as a looked-up path's, are stepped first, one at a time)."""
        for node in nodes:
            parent = grow.parents[node]
            if parent not in states:
                self._states([parent], grow, states)
        parents = torch.stack([states[grow.parents[n]] for n in nodes])
        embeds = self.tables.embeds(torch.tensor([grow.tokens[n] for n in nodes], device=self.device))
        out = self.context.step(parents, embeds)
        for node, s in zip(nodes, out):
            states[node] = s
        return out

    def _logits(self, k: int, states: torch.Tensor) -> torch.Tensor:
        """Head ``k``'s draft logits ``[m, K]`` of states ``[m, D]``."""
        return self.tables.logits(self.context.head(k, states)).float()

    def _root_state(self, root: int) -> torch.Tensor:
        """``s_1 = dec(s_0, e(root))`` ``[1, D]``."""
        embed = self.tables.embeds(torch.tensor([root], device=self.device))
        return self.context.step(self.context.last[None], embed)

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        if not self.ready(tokens, budget) or self.context.last is None:
            return DraftTree()
        root, depth = tokens[-1], min(self.depth, budget)
        state = self._root_state(root)
        if not self.params.greedy:
            drafted, qs = [], []
            for k in range(1, depth + 1):
                q = self.q(self._logits(k, state)[0])
                drafted.append(int(torch.multinomial(q, 1, generator=self.generator)))
                qs.append(q)
                if k < depth:
                    embed = self.tables.embeds(torch.tensor(drafted[-1:], device=self.device))
                    state = self.context.step(state, embed)
            return DraftTree.chain(drafted, torch.stack(qs))
        grow = DynamicTree(self.top_k, self.min_path_prob, self.end_ids)
        states = {-1: state[0]}
        room = min(self.max_nodes, budget)
        level = grow.add_children([-1], torch.log_softmax(self._logits(1, state), -1), self.tables.token_ids)
        grow.grow(level, depth - 1,  # expansion e runs head e + 1 on the frontier's states
                  lambda frontier, e: torch.log_softmax(self._logits(e + 1, self._states(frontier, grow, states)), -1),
                  self.tables.token_ids, lambda lv: self.look_up_under(grow, lv, tokens, room))
        return grow.result(room)
