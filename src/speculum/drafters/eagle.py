"""``eagle``: a trained feature-level draft head (EAGLE, Li et al. 2024) drafting EAGLE-2's dynamic
tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees").

The head (:mod:`speculum.heads.eagle`) reads the target's final-norm hidden state at each committed
token, which the engine hands over as the tokens are cached (:meth:`Drafter.see_hidden`). Each
step the head first catches up on the pairs it has not seen (``(f_t, x_{t+1})`` for every newly
cached ``t``, the target's true features), which predicts the root's feature. Then, greedy, it
grows EAGLE-2's dynamic tree (:mod:`speculum.drafting.tree_growth`): expanding a node is one
head forward whose pair is the parent's *predicted* feature and the node's token, attending the
node's ancestors in the head's cache; all nodes of one depth go in one forward.

With ``lookup`` (``k > 0``, greedy), after each depth the best path so far is looked up in the text
(:mod:`speculum.drafters.text_lookup`): where it occurred before, the ``k`` tokens that followed it
there hang under it and drafting stops. Copied text then costs one head forward, not one per depth.

``full_vocab`` drafts through the target's whole LM head even where the head was trained with a
trimmed one (``eagle_fullvocab``: what the trimming saves).

``device_tree`` (default: on CUDA devices) grows the greedy tree on the device in fixed shapes, as
EAGLE's reference implementation does, captured as one CUDA graph per cache bucket and read back
once per step (:mod:`speculum.drafters.device_tree`); the host growth reads the head's top-k back
after every depth. The lookup in the text then runs once, after the last depth.

Sampled requests draft a chain, each token drawn from the head's own distribution q (the request's
temperature / top-k / top-p applied to the draft logits), q attached for the verifier's ``min(1, p/q)``.
With a trimmed draft vocabulary, q is zero outside it: still exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafting.tree_growth import DynamicTree, sample_chain
from ..heads import HeadCache, head_for_target
from ..tree import DraftTree
from ..weights import model_device
from .base import Drafter
from .device_tree import DeviceTreeGrowth
from .text_lookup import TextLookup

CATCH_UP_CHUNK = 512  # pairs per head forward while catching up (a prompt's)
DEVICE_CACHE_SLOTS = 1024  # the device growth's head cache, at least (a power of two, kept across requests)


class EagleDrafter(TextLookup, Drafter):
    name = "eagle"

    def __init__(self, target: torch.nn.Module, draft_head: str | Path | None = None, top_k: int = 8,
                 depth: int = 6, max_nodes: int = 48, min_path_prob: float = 0.02, full_vocab: bool = False,
                 lookup: int = 8, device_tree: bool | None = None):
        self.head, self.tables, self.path = head_for_target(target, "eagle", draft_head, full_vocab)
        self.dtype, self.device = self.tables.embed.dtype, model_device(target)
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        cfg = self.head.config
        top = target.config.get_text_config().num_hidden_layers
        self.hidden_layers = cfg.fuse_layers or (top if cfg.feature_layer < 0 else cfg.feature_layer,)
        self.top_k, self.depth, self.max_nodes = top_k, depth, max_nodes
        self.min_path_prob = min_path_prob
        self.init_lookup(lookup)
        if device_tree is None:
            device_tree = self.device.type == "cuda"
        # the device growth needs the float LM head's rows (a quantized head runs on the CPU's kernels)
        self.device_tree = device_tree and self.tables.quantized is None and top_k > 0
        self._device: DeviceTreeGrowth | None = None  # its state and graphs, kept across requests
        self._device_cache: HeadCache | None = None

    def fork(self):
        twin = super().fork()
        twin._device, twin._device_cache = None, None  # a request of its own: its own cache and graphs
        return twin

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.cache = self._new_cache(len(prompt_ids) + 512)
        self.unseen: list[torch.Tensor] = []  # [m, D] (fused: [m, layers * D]) states of cached tokens not yet read
        self.fed = 0  # pairs committed to the head's cache: (f_t, x_{t+1}) for t < fed
        self.lost = False  # features went missing (cannot happen through the engine): draft nothing

    def _new_cache(self, slots: int) -> HeadCache:
        """A head cache of at least ``slots`` entries; with the device growth, the one it keeps (its
        graphs read the buffers), emptied, or a larger one."""
        if not self.device_tree:
            return HeadCache(self.head.config, slots, self.dtype, self.device)
        c = self._device_cache
        if c is None or c.k.shape[1] < slots:
            size = max(DEVICE_CACHE_SLOTS, 1 << (slots - 1).bit_length())
            c = self._device_cache = HeadCache(self.head.config, size, self.dtype, self.device)
        c.committed = c.used = 0
        return c

    def _growth(self) -> DeviceTreeGrowth:
        """The device growth over the current cache's buffers (made anew where they changed: a
        request outgrew them) and this request's end tokens."""
        d = self._device
        if d is None or d.kv.data_ptr() != self.cache.kv.data_ptr() or d.end_ids != self.end_ids:
            d = self._device = DeviceTreeGrowth(self.head, self.tables, self.cache.kv[0], self.top_k,
                                                self.depth, self.end_ids)
            self._device_cache = self.cache
        return d

    def see_hidden(self, hidden: dict[int, torch.Tensor]) -> None:
        self.unseen.append(torch.cat([hidden[i] for i in self.hidden_layers], dim=-1))

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        root_feat = self._catch_up(tokens)
        if root_feat is None or budget <= 0:
            return DraftTree()
        if not self.params.greedy:
            return self._sampled_chain(root_feat, len(tokens) - 1, min(budget, self.depth))
        return self._tree(root_feat, len(tokens) - 1, budget, tokens)

    def _catch_up(self, tokens: list[int]) -> torch.Tensor | None:
        """Feed the pairs ``t = fed .. len(tokens) - 2``; the root's predicted feature ``[D]``."""
        self.cache.rollback()
        feats = torch.cat(self.unseen) if self.unseen else None
        self.unseen = []
        n = len(tokens) - 1 - self.fed
        if self.lost or feats is None or feats.shape[0] != n:
            self.lost = self.lost or n > 0  # nothing new (a one-token prompt) is fine; a gap is not
            return None
        c = self.cache
        c.reserve(c.used + n + self.top_k * (1 + self.top_k * self.depth))
        ids = torch.tensor(tokens[self.fed + 1:], device=self.device)
        feats = feats.to(self.dtype)
        feats = self.head.drafting_features(feats)
        for lo in range(0, n, CATCH_UP_CHUNK):  # a long prompt in pieces: the mask is [rows, keys]
            m = min(CATCH_UP_CHUNK, n - lo)
            visible = torch.ones(m, c.used + m, dtype=torch.bool, device=self.device)
            visible[:, c.used:] = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
            positions = torch.arange(self.fed, self.fed + m, device=self.device)
            out = self.head.step(feats[lo:lo + m], self.tables.embeds(ids[lo:lo + m]), positions, c, visible)
            c.commit()
            self.fed += m
        return out[-1]

    def _sampled_chain(self, feat: torch.Tensor, root_pos: int, k: int) -> DraftTree:
        c, slots = self.cache, []  # the chain's pending head-cache slots

        def advance(tok: int, i: int) -> torch.Tensor:
            nonlocal feat
            visible = torch.zeros(1, c.used + 1, dtype=torch.bool, device=self.device)
            visible[0, :c.committed] = True
            visible[0, slots] = True
            visible[0, c.used] = True
            slots.append(c.used)
            feat = self.head.step(feat[None], self.tables.embeds(torch.tensor([tok], device=self.device)),
                                  torch.tensor([root_pos + i], device=self.device), c, visible)[0]
            return self._logits(feat)

        return sample_chain(self._logits(feat), k, self.params, self.generator, advance, self.end_ids)

    def _logits(self, feat: torch.Tensor) -> torch.Tensor:
        """A predicted feature ``[D]`` -> full-vocabulary logits ``[V]`` (float32)."""
        return self.tables.full_logits(self.tables.logits(feat).float(), self.vocab_size)

    def _tree(self, root_feat: torch.Tensor, root_pos: int, budget: int, tokens: list[int]) -> DraftTree:
        c = self.cache
        room = min(self.max_nodes, budget)
        growth = self._growth() if self.device_tree and self.depth > 1 else None
        if growth is not None and growth.fits(c.used):
            grow = growth.grow(root_feat, root_pos, c.used)
            self.look_up_under(grow, growth.last_level(grow), tokens, room)
            made = sum(score > float("-inf") for score in grow.scores)  # -inf: children of an end token
            return grow.result(min(room, made))
        grow = DynamicTree(self.top_k, self.min_path_prob, self.end_ids)
        slot: dict[int, int] = {}  # node -> its entry in the head's cache (expanded nodes)
        anc: dict[int, list[int]] = {-1: []}  # node -> cache slots of its expanded ancestors
        level = grow.add_children([-1], torch.log_softmax(self.tables.logits(root_feat[None]).float(), -1),
                                  self.tables.token_ids)
        feats = {-1: root_feat}

        def expand(frontier: list[int], depth: int) -> torch.Tensor:
            visible = grow.expansion_mask(frontier, c.used, slot, anc)
            visible[:, :c.committed] = True
            parent_feats = torch.stack([feats[grow.parents[i]] for i in frontier])
            ids = torch.tensor([grow.tokens[i] for i in frontier], device=self.device)
            positions = torch.full((len(frontier),), root_pos + depth - 1, device=self.device)
            out = self.head.step(parent_feats, self.tables.embeds(ids), positions, c,
                                 torch.from_numpy(visible).to(self.device))  # [m, D]
            feats.update(zip(frontier, out))
            return torch.log_softmax(self.tables.logits(out).float(), -1)

        grow.grow(level, min(self.depth, budget) - 1, expand, self.tables.token_ids,
                  lambda lv: self.look_up_under(grow, lv, tokens, room))
        return grow.result(room)
