"""``HFRunner``: the runner protocol on any transformers causal LM.

It drives the model's own modules through ``past_key_values`` (a view of speculum's
:class:`~speculum.cache.StaticKVCache`) and explicit 4-D attention masks, so it verifies trees as
well as chains. What makes it faster than ``model.generate``:

- the cache writes in place (no per-step ``torch.cat`` of every layer's keys and values);
- attention for grouped-query models runs on the KV heads directly: the query heads that share a
  KV head are folded into the query-length axis (``[1, H, n, D] -> [1, H_kv, g*n, D]``), so
  verifying ``n`` tokens never materialises ``repeat_kv`` copies of the cache, which transformers
  does whenever a mask is present;
- bfloat16 and float32 CPU linears run on oneDNN-prepacked weights where torch has oneDNN (and,
  for bfloat16, the CPU supports it) (:mod:`~speculum.runners.packed`).

The model object is not modified: the attention function and the packed linears are switched in
only for the duration of a runner forward, so ``model.generate`` (the ``hf`` baselines) still
runs transformers' own code.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from ..attention import Step, folded_attention, grouped, use_math_attention, visibility
from ..cache import StaticKVCache
from ..cache.store import put
from ..errors import SpeculumError
from ..models import context_length
from .base import Forward, RunnerBase, layer_types
from .packed import packed_linear

_ATTN_NAME = "speculum_sdpa"


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention on the KV heads without repeating them (transformers' attention-function interface).

    Shapes: query ``[1, H, n, D]``, key/value ``[1, H_kv, L, D]``, mask ``[1, 1, g*n, L]`` additive
    float, already repeated for the ``g = H / H_kv`` query heads per KV head (only
    :meth:`HFRunner._masks` builds masks for this function), or None. Returns ``[1, n, H, D]`` like
    transformers' attention functions. :func:`~speculum.attention.use_math_attention` picks the kernel.
    """
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention soft-capping is not supported by the speculum runner")
    b, h, n, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    q = query.reshape(b, hkv, g * n, d)  # heads h = kv*g + j, rows j*n + i
    scale = scaling if scaling is not None else d ** -0.5
    math = use_math_attention(g * n, query.device, key.shape[-2])
    out = folded_attention(q, key, value, attention_mask, scale, math=math, row_blocks=True)
    return out.reshape(b, h, n, value.shape[-1]).transpose(1, 2), None


AttentionInterface.register(_ATTN_NAME, _gqa_sdpa)


class _CacheView(Cache):
    """transformers' cache interface over a :class:`StaticKVCache`: a forward's keys and values go
    to the pending slots; each layer attends over the committed and pending entries."""

    def __init__(self, cache: StaticKVCache):
        super().__init__(layers=[])
        self.cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``key_states, value_states [1, H_kv, n, d]`` -> the layer's keys and values ``[1, H_kv,
        length + n, d]`` (views into the buffer)."""
        c = self.cache
        n = key_states.shape[2]
        end = c.length + n
        put(c.kv[layer_idx], c.length, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        c.pending = n
        return c.kv[layer_idx, 0, :, :end][None], c.kv[layer_idx, 1, :, :end][None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def __len__(self) -> int:
        return self.cache.kv.shape[0]


class HFRunner(RunnerBase):
    """Runner for a transformers ``*ForCausalLM`` (decoder-only, rotary positions).

    It refers to the model weakly (so that :func:`~speculum.runners.runner_for` can memoise runners
    per model without keeping models alive): keep the model while you use its runner.
    """

    def __init__(self, model: torch.nn.Module, prefill_chunk: int = 256):
        self._model = weakref.ref(model)
        cfg = model.config
        self.config = cfg
        self.generation_config = getattr(model, "generation_config", None)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = context_length(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = cfg.num_attention_heads // self.kv_heads  # query heads per KV head
        types = layer_types(cfg)
        self.sliding_window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
        self.uses_mask_mapping = len(set(types)) > 1  # mixed layers take a dict of masks
        self.prefill_chunk = prefill_chunk
        self.variant = "hf"
        with torch.inference_mode():
            self._linear_forwards = [(m, f) for m in model.modules() if isinstance(m, torch.nn.Linear)
                                     and (f := packed_linear(m.weight, m.bias)) is not None]

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise SpeculumError("this runner's model was freed; keep the model while you use its runner")
        return model

    def new_cache(self, capacity: int = 1024) -> StaticKVCache:
        return StaticKVCache(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device, capacity)

    @contextlib.contextmanager
    def _our_kernels(self):
        """Switch in our attention function and packed linears for one forward."""
        cfg = self.config
        old = cfg._attn_implementation
        cfg._attn_implementation = _ATTN_NAME
        for module, fwd in self._linear_forwards:
            object.__setattr__(module, "forward", fwd)  # an instance attribute shadows the class method
        try:
            yield
        finally:
            cfg._attn_implementation = old
            for module, _ in self._linear_forwards:
                del module.__dict__["forward"]

    def _masks(self, cache_len: int, step: Step):
        """The attention mask argument for the step's ``n`` new tokens after ``cache_len`` cached ones:
        None (attend to everything), a ``[1, 1, g*n, cache_len + n]`` additive mask (already repeated
        for the ``g`` query heads that share a KV head), or a dict ``{"full_attention": ...,
        "sliding_attention": ...}`` for models with mixed layers. transformers uses a 4-D mask as
        given, so a model whose layers all slide (Mistral with ``sliding_window``) gets the windowed mask.
        """
        full, sliding = visibility(cache_len, step.positions, step.new_mask, self.sliding_window)
        if not self.uses_mask_mapping:  # one kind of layer: `sliding` is `full` unless they all slide
            return self._additive(sliding)
        return {"full_attention": self._additive(full), "sliding_attention": self._additive(sliding)}

    def _additive(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[n, L]`` bool -> ``[1, 1, g*n, L]`` additive mask in the model's dtype."""
        add = grouped(mask, self.group, self.dtype)
        return None if add is None else add[None, None]

    prompt_rows = True

    def _run(self, cache: StaticKVCache, ids: list[int], step: Step, last_only: bool,
             hidden_layers: Sequence[int], extra_embeds: torch.Tensor | None = None) -> Forward:
        cache.reserve(cache.length + step.n)
        inputs = {"input_ids": torch.tensor([ids], device=self.device)}
        if extra_embeds is not None:  # prompt rows: the whole input as embeddings (Gemma's scale included)
            embeds = self.model.get_input_embeddings()(inputs["input_ids"])
            inputs = {"inputs_embeds": torch.cat((embeds, extra_embeds.to(embeds.dtype)[None]), dim=1)}
        with self._our_kernels():
            out = self.model(
                **inputs,
                position_ids=step.positions[None],
                attention_mask=self._masks(cache.length, step),
                past_key_values=_CacheView(cache),
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                output_hidden_states=bool(hidden_layers),
            )
        hidden = {i: out.hidden_states[i][0] for i in hidden_layers}
        return Forward(out.logits[0], hidden)
