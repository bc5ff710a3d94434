"""``ppd``: Parallel Prompt Decoding (Chen et al. 2024): trained prompt tokens ride in the
verification forward and the target itself predicts the next step's drafts.

Every tree this drafter proposes carries :class:`~speculum.tree.PromptRows`: the prompt tokens
(:mod:`speculum.heads.ppd`) after the root and after the nodes most likely to end the accepted
path. After verification the outputs of the rows hung after the last accepted node (the root when
nothing was accepted) predict the tokens after the bonus token: depth ``d`` of the next tree takes
its candidates from prompt position ``d``'s ``top_k`` tokens (the same for every parent, as in
Medusa), grown best-first by the product of their probabilities
(:func:`~speculum.drafting.tree_growth.product_tree`). Its nodes'
scores feed the engine's tree sizer, PPD's hardware-aware sparse tree; prompt rows follow the
nodes the sizer keeps.

Which nodes get which prompt rows: a node's chance of being the last accepted one is its score
minus its children's; the root gets all ``N`` positions, and so do up to ``max_anchors`` nodes in
falling order of that chance, while it is at least ``min_anchor``; every other node gets the first
position only (as in the paper, every node gets at least one row), so the next step can always
draft at least one depth.

Sampled requests draft a chain, token ``d`` drawn from prompt position ``d``'s distribution q (the
request's temperature / top-k / top-p applied), q attached for the verifier. Runners that leave
prompt rows out (batched steps, the reproducible mode, KV policies) make it draft nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..drafting.tree_growth import product_tree
from ..heads import head_for_target
from ..tree import DraftTree, PromptRows
from ..verify import Acceptance
from .base import Drafter


class PPDDrafter(Drafter):
    name = "ppd"

    def __init__(self, target: torch.nn.Module, draft_head: str | Path | None = None, top_k: int = 8,
                 max_nodes: int = 32, max_anchors: int = 4, min_anchor: float = 0.05):
        self.prompts, _, self.path = head_for_target(target, "ppd", draft_head)
        self.embeds = self.prompts.embeddings.detach()  # [N * E, D] in the target's dtype
        self.depth = self.prompts.config.num_prompts
        self.top_k, self.max_nodes, self.max_anchors, self.min_anchor = top_k, max_nodes, max_anchors, min_anchor

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.next_logits: torch.Tensor | None = None  # [N, V] the last step's predictions for this one

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        logits, self.next_logits = self.next_logits, None
        tree = DraftTree()
        if logits is not None and budget > 0:
            depth = min(self.depth, budget, logits.shape[0])
            if not self.params.greedy:
                qs = [self.params.probs(logits[d].float()) for d in range(depth)]
                drafted = [int(torch.multinomial(q, 1, generator=self.generator)) for q in qs]
                tree = DraftTree.chain(drafted, torch.stack(qs))
            else:
                top = torch.log_softmax(logits[:depth].float(), -1).topk(self.top_k, dim=-1)
                tree = product_tree(top.indices.tolist(), top.values.tolist(), min(self.max_nodes, budget))
        return self._with_prompt_rows(tree)

    def _with_prompt_rows(self, tree: DraftTree) -> DraftTree:
        """``tree`` with prompt rows: all ``N`` positions after the root and after its likeliest
        last-accepted nodes, the first position after every other node."""
        full = {-1}
        if len(tree) and tree.scores is not None:
            last = list(tree.scores)  # P(node accepted) - P(some child accepted) = P(node ends the path)
            for i, p in enumerate(tree.parents):
                if p >= 0:
                    last[p] -= tree.scores[i]
            best = sorted(range(len(tree)), key=lambda i: -last[i])[:self.max_anchors]
            full.update(i for i in best if last[i] >= self.min_anchor)
        else:  # a sampled chain: its deepest nodes
            full.update(range(len(tree) - 1, -1, -1)[:self.max_anchors])
        chain, offsets, r = self.prompts.chain_mask(), self.prompts.offsets(), self.prompts.config.ensemble
        anchors, offs, rows, blocks = [], [], [], []
        for a in [-1, *range(len(tree))]:
            k = len(offsets) if a in full else r  # every member of the first position, or of all
            anchors += [a] * k
            offs += offsets[:k]
            rows.append(self.embeds[:k])
            blocks.append(chain[:k, :k])
        among = np.zeros((len(anchors), len(anchors)), dtype=bool)
        at = 0
        for b in blocks:
            among[at:at + len(b), at:at + len(b)] = b
            at += len(b)
        tree.prompts = PromptRows(anchors, offs, torch.cat(rows), among)
        return tree

    def see_prompt_logits(self, tree: DraftTree, acceptance: Acceptance, logits: torch.Tensor | None) -> None:
        if logits is None:
            return
        last = acceptance.path[-1] if acceptance.path else -1
        rows = [r for r, a in enumerate(tree.prompts.anchors) if a == last]
        if rows:  # in offset order: one chain's rows were added together
            self.next_logits = self.prompts.combine(logits[rows])
