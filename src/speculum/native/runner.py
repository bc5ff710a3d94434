"""``NativeRunner``: the :class:`~speculum.runner.Runner` protocol on :class:`NativeDecoder`.

- CPU: eager forwards of the native decoder (fused projections, oneDNN-packed bfloat16
  weights, grouped-query attention without repeated KV heads, no per-module Python overhead).
- CUDA: verification forwards replay CUDA graphs (:mod:`speculum.native.graphs`) over one
  static KV buffer the runner owns; prefill and shapes outside the graph buckets run eagerly.
  Because the graphs hold that buffer's address, one cache at a time owns it: :meth:`new_cache`
  hands the buffer to a new cache when no live cache holds it, and otherwise returns a private
  cache whose steps run eagerly (a draft model sharing the target's runner, say).
"""

from __future__ import annotations

import os
import weakref

import torch

from ..attention import grouped, visibility
from ..models import context_length
from ..tree import DraftTree
from .cache import StaticKVCache
from .model import NativeDecoder

DEFAULT_GRAPH_CONTEXT = 4096


class NativeRunner:
    """Runner for Llama-family and Gemma-3 models on the native decoder.

    Args:
        model: a transformers ``*ForCausalLM`` (weights are re-laid out once; the model is untouched).
        prefill_chunk: prefill in chunks of this many tokens (bounds attention memory).
        cuda_graphs: capture verification steps as CUDA graphs (default: on CUDA devices, unless
            ``SPECULUM_CUDA_GRAPHS=0``). ``"padded"`` runs the same padded fixed-shape steps
            without capturing them (any device: how the graph path is tested on a CPU).
        graph_context: slots of the static buffer the graphs use; longer sequences run eagerly
            (default ``min(max_positions, 4096)``).
    """

    def __init__(self, model: torch.nn.Module, prefill_chunk: int = 256, cuda_graphs: bool | str | None = None,
                 graph_context: int | None = None):
        self.model = model
        self.config = model.config
        self.decoder = NativeDecoder.from_hf(model)
        s = self.decoder.shape
        self.shape = s
        self.device, self.dtype = self.decoder.device, self.decoder.dtype
        self.vocab_size = s.vocab
        self.max_positions = context_length(self.config)
        self.prefill_chunk = prefill_chunk
        self.variant = "fused" if self.decoder.fused else "exact"  # part of the calibration key
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get("SPECULUM_CUDA_GRAPHS", "1") != "0"
        self.graphs = None
        self._owner = None  # weak reference to the cache that holds the graphs' buffer
        if cuda_graphs:
            from .graphs import GraphedSteps

            ctx = graph_context or min(self.max_positions, DEFAULT_GRAPH_CONTEXT)
            # zeros, not empty: the graphs attend over every slot of a bucket and mask by addition, so an
            # unwritten slot must hold finite numbers (NaN garbage times a zero weight is still NaN)
            buf = torch.zeros((s.layers, 2, s.kv_heads, ctx, s.head_dim), dtype=self.dtype, device=self.device)
            self.graphs = GraphedSteps(self.decoder, buf, capture=cuda_graphs != "padded",
                                       compile=os.environ.get("SPECULUM_COMPILE", "0") == "1")
            self.variant += f" graphs={cuda_graphs} context={ctx}"

    def new_cache(self, capacity: int = 1024) -> StaticKVCache:
        s = self.shape
        free = self._owner is None or self._owner() is None
        if self.graphs is not None and capacity <= self.graphs.capacity and free:
            cache = StaticKVCache(s.layers, s.kv_heads, s.head_dim, self.dtype, self.device, capacity,
                                  buffer=self.graphs.kv)
            self._owner = weakref.ref(cache)
            return cache
        return StaticKVCache(s.layers, s.kv_heads, s.head_dim, self.dtype, self.device, capacity)

    def _check_owner(self, cache: StaticKVCache) -> None:
        if cache.fixed and (self._owner is None or self._owner() is not cache):
            raise RuntimeError("this KV cache's buffer belongs to another runner or cache")

    def _masks(self, length: int, positions: torch.Tensor, new_mask: torch.Tensor | None):
        """``{sliding: [g*n, length+n] additive or None}`` for ``n`` new tokens after ``length`` slots.

        ``new_mask [n, n]`` bool among the new tokens (None = causal). On sliding layers keys more
        than ``window - 1`` positions behind the query are hidden (transformers' rule).
        """
        s = self.shape
        full, sliding = visibility(length, positions, new_mask, s.sliding_window)
        return {False: grouped(full, s.group, self.dtype), True: grouped(sliding, s.group, self.dtype)}

    @torch.inference_mode()
    def _eager(self, cache: StaticKVCache, ids: list[int], positions: torch.Tensor,
               new_mask: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        n = len(ids)
        cache.reserve(cache.length + n)
        masks = self._masks(cache.length, positions, new_mask)
        ids_t = torch.tensor(ids, device=self.device)
        logits = self.decoder.forward(ids_t, positions, cache.kv, cache.length, cache.length + n, masks, last_only)
        cache.pending = n
        return logits

    def prefill(self, cache: StaticKVCache, token_ids: list[int]) -> None:
        """Commit ``token_ids`` to the cache in chunks of ``prefill_chunk`` tokens."""
        self._check_owner(cache)
        cache.reserve(cache.length + len(token_ids))
        for start in range(0, len(token_ids), self.prefill_chunk):
            chunk = token_ids[start:start + self.prefill_chunk]
            pos = torch.arange(cache.length, cache.length + len(chunk), device=self.device)
            self._eager(cache, chunk, pos, None, last_only=True)
            cache.commit()

    def forward_tree(self, cache: StaticKVCache, root: int, tree: DraftTree) -> torch.Tensor:
        """Logits ``[n + 1, V]`` for ``[root] + tree.tokens``; their KV entries are left pending."""
        self._check_owner(cache)
        ids = [root] + tree.tokens
        depths = [0] + tree.depths()
        chain = tree.is_chain
        if self.graphs is not None and cache.fixed:
            shapes = self.graphs.shapes_for(cache.length, len(ids))
            if shapes is not None:
                logits = self.graphs.run(cache.length, ids, depths, None if chain else tree.ancestor_mask_np(),
                                         shapes)
                cache.pending = len(ids)
                return logits
        positions = torch.tensor(depths, device=self.device) + cache.length
        mask = None if chain else tree.ancestor_mask(self.device)
        return self._eager(cache, ids, positions, mask, last_only=False)
