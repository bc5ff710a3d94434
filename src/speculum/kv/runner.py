"""``PolicyRunner``: the :class:`~speculum.runner.Runner` protocol with a KV policy in the loop.

It wraps a :class:`~speculum.native.NativeRunner` (the policies need the native decoder's
per-layer hooks): prefill runs layer by layer (:func:`~speculum.kv.prefill.prefill_layerwise`)
and hands each layer to the policy; every forward's attention goes through the policy's
:meth:`~speculum.kv.base.KVPolicy.attend`. Forwards run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import torch

from ..errors import SpeculumError
from ..tree import DraftTree
from .cache import Step
from .prefill import prefill_layerwise


class PolicyRunner:
    """Runs a model under a KV policy (one policy object serves many requests; state lives in the cache)."""

    def __init__(self, runner, policy):
        from ..native import NativeRunner

        if not isinstance(runner, NativeRunner):
            raise SpeculumError("KV policies run on the native runner (Llama-family and Gemma-3 models); "
                                "this model runs on the Hugging Face runner")
        self.inner, self.policy = runner, policy
        self.decoder = runner.decoder
        self.model, self.config = runner.model, runner.config
        self.vocab_size, self.device, self.dtype = runner.vocab_size, runner.device, runner.dtype
        self.max_positions = runner.max_positions
        self.prefill_chunk = runner.prefill_chunk
        self.variant = f"{runner.variant} kv={policy!r}"

    def new_cache(self, capacity: int = 1024):
        return self.policy.new_cache(self, capacity)

    def prefill(self, cache, token_ids: list[int]) -> None:
        """Layer-by-layer prefill of an empty cache; the policy stores each layer as it completes."""
        if cache.length or cache.pending:
            raise RuntimeError("a KV policy's prefill needs an empty cache")
        self.policy.begin_prefill(cache, len(token_ids))
        if token_ids:
            prefill_layerwise(self.decoder, token_ids, self.prefill_chunk, self.policy.prefill_scores,
                              self.policy.observation_window,
                              lambda i, sliding, kv, scores: self.policy.store_prefill(cache, i, sliding, kv, scores))
        self.policy.end_prefill(cache, len(token_ids))

    @torch.inference_mode()
    def forward_tree(self, cache, root: int, tree: DraftTree) -> torch.Tensor:
        """Logits ``[n + 1, V]`` for ``[root] + tree.tokens``; their KV entries are left pending."""
        ids = [root] + tree.tokens
        n = len(ids)
        positions = torch.tensor([0] + tree.depths(), device=self.device) + cache.position
        new_mask = None
        if n > 1:
            new_mask = (torch.ones(n, n, dtype=torch.bool, device=self.device).tril() if tree.is_chain
                        else tree.ancestor_mask(self.device))
        step = Step(positions, new_mask, self.decoder, self.decoder.shape.sliding_window)
        cache.begin(positions)
        policy = self.policy

        def attend(i, layer, q, k, v):
            return policy.attend(cache, i, layer.sliding, q, k, v, step)

        logits = self.decoder.forward_with(torch.tensor(ids, device=self.device), positions, attend)
        cache.pending = n
        return logits
