"""``kangaroo``: self-speculation through the target's first layers and a trained adapter (Kangaroo,
Liu et al. 2024).

The draft model is the target's own first ``exit_layer`` layers (run natively over a KV buffer of
their own, :class:`~speculum.drafting.layer_subset.LayerSubset`), the adapter
(:mod:`speculum.heads.kangaroo`) and the target's LM head (trimmed to the draft vocabulary when
the head was trained with one). Each step it first feeds the tokens committed since the last step,
the root included, through the layers and the adapter (committed to both caches); the root's
output gives the first depth. Drafting then stops early, the paper's second early exit, where the
draft is unsure: with ``top_k=1`` (the paper's chains) when a token's own probability is below
``exit_confidence``; with wider trees (EAGLE-2's dynamic tree,
:mod:`speculum.drafting.tree_growth`) where a path's probability falls below ``min_path_prob``.
Expanding a node runs its token through the shallow layers and the adapter, attending its
ancestors' pending entries; all nodes of one depth go in one call.

With ``lookup`` (greedy), after each depth the best path is looked up in the text
(:mod:`speculum.drafters.text_lookup`): where it occurred before, what followed it there ends the
draft without further draft forwards.

Sampled requests draft a chain, each token drawn from the draft's own distribution q, q attached
for the verifier. The verifier recomputes the drafted tokens' shallow layers (the paper reuses
them); that costs ``exit_layer`` layers of rows per step.

Needs the native runner's decoder (Llama family, Gemma-3).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafting.layer_subset import LayerSubset
from ..drafting.tree_growth import DynamicTree, sample_chain
from ..errors import SpeculumError
from ..heads import HeadCache, head_for_target
from ..tree import DraftTree
from .base import Drafter
from .self_draft import native_decoder
from .text_lookup import TextLookup

CATCH_UP_CHUNK = 512  # tokens per shallow forward while catching up (a prompt's)


class KangarooDrafter(TextLookup, Drafter):
    name = "kangaroo"

    def __init__(self, target: torch.nn.Module, draft_head: str | Path | None = None, top_k: int = 1,
                 depth: int = 6, max_nodes: int = 24, exit_confidence: float = 0.6, min_path_prob: float = 0.02,
                 lookup: int = 8):
        self.adapter, self.tables, self.path = head_for_target(target, "kangaroo", draft_head)
        self.decoder = native_decoder(target, self.name)
        if self.adapter.config.exit_layer > self.decoder.shape.layers:
            raise SpeculumError(f"{self.path} exits after layer {self.adapter.config.exit_layer}; this model has "
                                f"{self.decoder.shape.layers}")
        self.device, self.dtype = self.decoder.device, self.decoder.dtype
        self.vocab_size = self.decoder.shape.vocab
        self.top_k, self.depth, self.max_nodes = top_k, depth, max_nodes
        self.exit_confidence, self.min_path_prob = exit_confidence, min_path_prob
        self.init_lookup(lookup)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        capacity = len(prompt_ids) + 512
        self.shallow = LayerSubset(self.decoder, range(self.adapter.config.exit_layer), capacity)
        self.cache = HeadCache(self.adapter.config, capacity, self.dtype, self.device)
        self.fed = 0  # tokens committed to both caches

    def _run(self, ids: list[int], positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Rows through the shallow layers and the adapter: ``visible [n, used + n]`` (both caches hold
        the same slots) -> predicted features ``[n, D]``."""
        states = self.shallow.run(torch.tensor(ids, device=self.device), positions, visible)
        return self.adapter.step(states, positions, self.cache, visible)

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Commit ``tokens[fed:]`` (the root included) to both caches; the root's feature ``[D]``."""
        self.shallow.rollback()
        self.cache.rollback()
        n = len(tokens) - self.fed
        self.cache.reserve(self.cache.used + n + self.depth * max(self.top_k, 1) + 1)
        for lo in range(0, n, CATCH_UP_CHUNK):
            m = min(CATCH_UP_CHUNK, n - lo)
            at = self.shallow.used
            visible = torch.ones(m, at + m, dtype=torch.bool, device=self.device)
            visible[:, at:] = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
            positions = torch.arange(self.fed, self.fed + m, device=self.device)
            out = self._run(tokens[self.fed:self.fed + m], positions, visible)
            self.shallow.commit()
            self.cache.commit()
            self.fed += m
        return out[-1]

    def _logp(self, feats: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[m, D]`` -> draft-vocabulary log-probabilities ``[m, K]``."""
        return torch.log_softmax(self.tables.logits(feats).float(), -1)

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        root_feat = self._catch_up(tokens)
        if budget <= 0:
            return DraftTree()
        if not self.params.greedy:
            return self._sampled_chain(root_feat, len(tokens) - 1, min(budget, self.depth))
        return self._tree(root_feat, len(tokens) - 1, budget, tokens)

    def _sampled_chain(self, feat: torch.Tensor, root_pos: int, k: int) -> DraftTree:
        logits = lambda f: self.tables.full_logits(self.tables.logits(f[None]).float()[0], self.vocab_size)

        def advance(tok: int, i: int) -> torch.Tensor:
            visible = torch.ones(1, self.shallow.used + 1, dtype=torch.bool, device=self.device)
            return logits(self._run([tok], torch.tensor([root_pos + i + 1], device=self.device), visible)[0])

        return sample_chain(logits(feat), k, self.params, self.generator, advance, self.end_ids)

    def _tree(self, root_feat: torch.Tensor, root_pos: int, budget: int, tokens: list[int]) -> DraftTree:
        grow = DynamicTree(self.top_k, self.min_path_prob if self.top_k > 1 else 0.0, self.end_ids)
        slot: dict[int, int] = {}  # expanded node -> its pending slot (in both caches)
        anc: dict[int, list[int]] = {-1: []}  # node -> pending slots of its expanded ancestors
        room = min(self.max_nodes, budget)
        level = grow.add_children([-1], self._logp(root_feat[None]), self.tables.token_ids)

        def expand(frontier: list[int], depth: int) -> torch.Tensor:
            visible = grow.expansion_mask(frontier, self.shallow.used, slot, anc)
            visible[:, :self.shallow.committed] = True
            positions = torch.full((len(frontier),), root_pos + depth, device=self.device)
            return self._logp(self._run([grow.tokens[i] for i in frontier], positions,
                                        torch.from_numpy(visible).to(self.device)))

        # the paper's early exit (top_k 1): the token's own confidence
        grow.grow(level, min(self.depth, budget) - 1, expand, self.tables.token_ids,
                  lambda lv: self.look_up_under(grow, lv, tokens, room),
                  self.exit_confidence if self.top_k == 1 else None)
        return grow.result(room)
