"""``medusa``: Medusa-1 heads (Cai et al. 2024) on the frozen target's last feature.

Head ``k`` (:mod:`speculum.heads.medusa`) reads the feature of the token before the root (the last
one cached, whose LM-head output chose the root) and predicts the token at depth ``k`` below the
root, whatever the tokens in between. A greedy step runs every head once and builds the tree
best-first from the product of the heads' probabilities
(:func:`~speculum.drafting.tree_growth.product_tree`): a node at depth ``k`` is one of head
``k``'s ``top_k`` tokens, its score the product of its path's probabilities; the engine's tree
sizer trims by those scores. Sampled requests draft a chain, token ``k`` drawn from head ``k``'s
distribution q (the request's temperature / top-k / top-p applied), q attached for the verifier.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafting.tree_growth import product_tree
from ..heads import head_for_target
from ..tree import DraftTree
from ..weights import model_device
from .base import Drafter


class HeadDrafter(Drafter):
    """A drafter of learned heads that reads the target's final feature of the last cached token
    (``medusa``, ``hydra``): loads the head and keeps that feature."""

    kind = ""

    def __init__(self, target: torch.nn.Module, draft_head: str | Path | None = None, top_k: int = 8,
                 max_nodes: int = 48):
        self.head, self.tables, self.path = head_for_target(target, self.kind, draft_head)
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.device = model_device(target)
        self.hidden_layers = (target.config.get_text_config().num_hidden_layers,)
        self.depth = self.head.config.num_heads
        self.top_k, self.max_nodes = top_k, max_nodes

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.feat: torch.Tensor | None = None  # [D] the feature of the last cached token
        self.seen = 0  # cached tokens whose features came

    def see_hidden(self, hidden: dict[int, torch.Tensor]) -> None:
        rows = hidden[self.hidden_layers[0]]
        self.feat, self.seen = rows[-1], self.seen + rows.shape[0]

    def ready(self, tokens: list[int], budget: int) -> bool:
        """Whether this step can draft: a budget, and the feature of the token before the root."""
        return budget > 0 and self.feat is not None and self.seen == len(tokens) - 1

    def q(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The request's sampling distribution ``[V]`` of draft logits ``[K]`` (zero outside a
        trimmed draft vocabulary)."""
        return self.params.probs(self.tables.full_logits(draft_logits, self.vocab_size))


class MedusaDrafter(HeadDrafter):
    name = kind = "medusa"

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        if not self.ready(tokens, budget):
            return DraftTree()
        logits = self.head.draft_logits(self.feat, self.tables).float()  # [K heads, K vocab]
        depth = min(self.depth, budget)
        if not self.params.greedy:
            drafted, qs = [], []
            for k in range(depth):
                q = self.q(logits[k])
                drafted.append(int(torch.multinomial(q, 1, generator=self.generator)))
                qs.append(q)
            return DraftTree.chain(drafted, torch.stack(qs))
        top = torch.log_softmax(logits[:depth], -1).topk(min(self.top_k, logits.shape[-1]), dim=-1)
        return product_tree(self.tables.token_ids(top.indices).tolist(), top.values.tolist(), min(self.max_nodes, budget))
