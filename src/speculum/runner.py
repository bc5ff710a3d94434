"""Runners turn (token ids, positions, tree mask, cache) into logits.

:class:`HFRunner` drives any transformers causal LM through ``past_key_values`` (our
:class:`~speculum.cache.KVCache`) and explicit 4-D attention masks, so it verifies trees as well
as chains. Two things make it faster than ``model.generate`` on a CPU:

- the cache writes in place (no per-step ``torch.cat`` of every layer's keys and values);
- attention for grouped-query models runs on the KV heads directly: the query heads that share
  a KV head are folded into the query-length axis (``[1, H, n, D] -> [1, H_kv, g*n, D]``), so
  verifying ``n`` tokens never materialises ``repeat_kv`` copies of the cache, which transformers
  does whenever a mask is present.

- on CPUs with oneDNN bfloat16 support, every ``nn.Linear`` runs through oneDNN with weights
  prepacked once into its blocked layout (``torch.ops.mkldnn._linear_pointwise``): measured here
  2-4x faster than ``F.linear`` in bfloat16 for the 1-16 token inputs that decoding and
  verification feed (the lm-head of SmolLM2: 0.65 ms instead of 2.8 ms for one token). The packed
  copies cost one more copy of the linear weights in memory. ``SPECULUM_PACKED_LINEAR=0`` disables it.

The model object is not modified: our attention function and the packed linears are switched in
only for the duration of a runner forward, so ``model.generate`` (the ``hf`` baselines) still
runs transformers' own code.

Masks: the cache part of every row is visible except, on sliding-window layers, keys more than
``window - 1`` positions behind the query (transformers' rule ``kv_pos > q_pos - window``); the
new part is the tree's ancestor mask.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

import torch
from transformers import AttentionInterface

from .attention import folded_attention, grouped, use_math_attention, visibility
from .cache import KVCache
from .errors import SpeculumError
from .models import context_length
from .tree import DraftTree

_ATTN_NAME = "speculum_sdpa"
def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention on the KV heads without repeating them (transformers' attention-function interface).

    Shapes: query ``[1, H, n, D]``, key/value ``[1, H_kv, L, D]``, mask ``[1, 1, g*n, L]`` additive
    float, already repeated for the ``g = H / H_kv`` query heads per KV head (only
    :meth:`HFRunner._masks` builds masks for this function), or None. Returns ``[1, n, H, D]`` like
    transformers' attention functions. :func:`use_math_attention` picks the kernel.
    """
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention soft-capping is not supported by the speculum runner")
    b, h, n, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    q = query.reshape(b, hkv, g * n, d)  # heads h = kv*g + j, rows j*n + i
    scale = scaling if scaling is not None else d ** -0.5
    out = folded_attention(q, key, value, attention_mask, scale, math=use_math_attention(g * n, query.device))
    return out.reshape(b, h, n, value.shape[-1]).transpose(1, 2), None


AttentionInterface.register(_ATTN_NAME, _gqa_sdpa)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x [..., in] -> [..., out]`` on oneDNN-prepacked weights for a bfloat16 CPU linear layer, or
    None where that does not apply (another dtype or device, no oneDNN bfloat16 support, or
    ``SPECULUM_PACKED_LINEAR=0``). The packed copy is made once, here."""
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
            or os.environ.get("SPECULUM_PACKED_LINEAR", "1") == "0"
            or not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    bias = None if bias is None else bias.detach()
    out_features = weight.shape[0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias,
                                               "none", [], "")
        return y.reshape(*x.shape[:-1], out_features)

    return forward


def _packed_linear_forwards(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """``(linear, forward)`` pairs running each bfloat16 CPU ``nn.Linear`` on prepacked oneDNN weights."""
    pairs = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and (fwd := packed_linear(module.weight, module.bias)) is not None:
            pairs.append((module, fwd))
    return pairs


def layer_types(config) -> list[str]:
    """``"full_attention"`` or ``"sliding_attention"`` per layer.

    transformers configs list them (``layer_types``) for Gemma-3, Qwen2/3 and others; Mistral
    configs only give ``sliding_window``, which then applies to every layer.
    """
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    if getattr(config, "model_type", "") == "mistral" and getattr(config, "sliding_window", None):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class Runner(Protocol):
    """What the engine needs from a model."""

    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary)
    device: torch.device
    max_positions: int

    def new_cache(self, capacity: int) -> KVCache: ...

    def prefill(self, cache: KVCache, token_ids: list[int]) -> None: ...

    def forward_tree(self, cache: KVCache, root: int, tree: DraftTree) -> torch.Tensor: ...


class HFRunner:
    """Runner for a transformers ``*ForCausalLM`` (decoder-only, rotary positions)."""

    def __init__(self, model: torch.nn.Module, prefill_chunk: int = 256):
        self.model = model
        cfg = model.config
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = context_length(self.config)
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = cfg.num_attention_heads // self.kv_heads  # query heads per KV head
        types = layer_types(cfg)
        self.sliding_window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
        self.uses_mask_mapping = len(set(types)) > 1  # mixed layers take a dict of masks
        self.prefill_chunk = prefill_chunk
        with torch.inference_mode():
            self._linear_forwards = _packed_linear_forwards(model)

    def new_cache(self, capacity: int = 1024) -> KVCache:
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device, capacity)

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

    def _masks(self, cache_len: int, positions: torch.Tensor, new_mask: torch.Tensor | None):
        """Build the attention mask argument for ``n`` new tokens after ``cache_len`` cached ones.

        Args:
            positions: ``[n]`` positions of the new tokens.
            new_mask: ``[n, n]`` bool among the new tokens (True = visible), or None for causal.
        Returns None (attend to everything), a ``[1, 1, g*n, cache_len + n]`` additive float mask
        (0 or -inf; built once per forward and already repeated for the ``g`` query heads that share
        a KV head), or a dict ``{"full_attention": ..., "sliding_attention": ...}`` for models with
        mixed layers. transformers uses a 4-D mask as given, so a model whose layers all slide
        (Mistral with ``sliding_window``) gets the windowed mask.
        """
        full, sliding = visibility(cache_len, positions, new_mask, self.sliding_window)
        if not self.uses_mask_mapping:  # one kind of layer: `sliding` is `full` unless they all slide
            return self._additive(sliding)
        return {"full_attention": self._additive(full), "sliding_attention": self._additive(sliding)}

    def _additive(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[n, L]`` bool -> ``[1, 1, g*n, L]`` additive mask in the model's dtype."""
        add = grouped(mask, self.group, self.dtype)
        return None if add is None else add[None, None]

    def _forward(self, cache: KVCache, ids: list[int], positions: torch.Tensor,
                 new_mask: torch.Tensor | None, logits_to_keep: int) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=self.device)
        mask = self._masks(cache.length, positions, new_mask)
        with torch.inference_mode(), self._our_kernels():
            out = self.model(
                input_ids=input_ids,
                position_ids=positions[None],
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        return out.logits[0]

    def prefill(self, cache: KVCache, token_ids: list[int]) -> None:
        """Commit ``token_ids`` to the cache in chunks of ``prefill_chunk`` tokens.

        Chunks bound the attention's memory. 256 rather than 512: on the 2-core development CPU
        a 900-token bfloat16 prefill took 0.48 s in 256-token chunks and 0.50-0.74 s in 512-token
        chunks (the larger chunks' activations fall out of cache).
        """
        cache.reserve(cache.length + len(token_ids))
        for start in range(0, len(token_ids), self.prefill_chunk):
            chunk = token_ids[start:start + self.prefill_chunk]
            pos = torch.arange(cache.length, cache.length + len(chunk), device=self.device)
            self._forward(cache, chunk, pos, None, logits_to_keep=1)
            cache.commit()

    def forward_tree(self, cache: KVCache, root: int, tree: DraftTree) -> torch.Tensor:
        """Logits ``[n + 1, V]`` for ``[root] + tree.tokens``; their KV entries are left pending."""
        depth = torch.tensor([0] + tree.depths(), device=self.device)
        positions = depth + cache.length
        new_mask = None if tree.is_chain else tree.ancestor_mask(self.device)
        return self._forward(cache, [root] + tree.tokens, positions, new_mask, logits_to_keep=0)


RUNNER_KINDS = ("auto", "native", "hf")


def _check_kind(kind: str) -> None:
    if kind not in RUNNER_KINDS:
        raise SpeculumError(f"unknown runner {kind!r}; choose from {', '.join(RUNNER_KINDS)}")


def use_runner(model: torch.nn.Module, kind: str) -> None:
    """Make ``kind`` (``auto``, ``native`` or ``hf``) the runner every engine method builds for ``model``."""
    runner_for(model, kind)  # fails now, clearly, if the kind cannot run this model
    model.__dict__["_speculum_runner_kind"] = kind


def runner_for(model: torch.nn.Module, kind: str | None = None):
    """The model's runner, built once per kind and kept on the model (re-laying weights takes time).

    ``kind``: ``"native"`` (:class:`~speculum.native.NativeRunner`; raises
    :class:`~speculum.errors.SpeculumError` for an unsupported architecture), ``"hf"``
    (:class:`HFRunner`, any transformers causal LM) or ``"auto"``: native where the architecture is
    supported, else hf. None: the kind set by :func:`use_runner` for this model, else
    ``SPECULUM_RUNNER``, else ``auto``.
    """
    from .native import NativeRunner, unsupported_reason

    kind = kind or model.__dict__.get("_speculum_runner_kind") or os.environ.get("SPECULUM_RUNNER", "auto")
    _check_kind(kind)
    if kind == "auto":
        kind = "hf" if unsupported_reason(model.config) else "native"
    elif kind == "native" and (reason := unsupported_reason(model.config)):
        raise SpeculumError(f"the native runner does not support {reason}; use --runner hf")
    if kind == "hf" and weights_released(model):
        raise SpeculumError("this model's layer weights were released to its native runner "
                            "(release_model_weights); load the model again to run it with transformers")
    runners = model.__dict__.setdefault("_speculum_runners", {})
    if kind not in runners:
        runners[kind] = NativeRunner(model) if kind == "native" else HFRunner(model)
    return runners[kind]


_RELEASED = "_speculum_weights_released"


def weights_released(model: torch.nn.Module) -> bool:
    """Whether :func:`release_model_weights` has run on ``model`` (then only the native runner can run it)."""
    return bool(model.__dict__.get(_RELEASED))


@torch.no_grad()
def release_model_weights(model: torch.nn.Module) -> int:
    """Free the transformers model's decoder-layer linear weights that its native runner holds copies of.

    The native runner re-lays the projections out (fused QKV and gate/up, oneDNN-packed in
    bfloat16 on the CPU), so after it is built the process holds every linear weight twice: about
    0.2 GB for SmolLM2-135M in bfloat16. This replaces each layer's ``nn.Linear`` weights (and biases)
    with meta tensors of the same shape. Afterwards the model runs only through
    ``runner_for(model, "native")``: the hf runner and transformers' ``generate`` (the ``hf``
    methods) refuse it with a :class:`~speculum.errors.SpeculumError`. Embeddings, norms and the
    output head stay (the native decoder reads the embedding table in place).

    Raises :class:`~speculum.errors.SpeculumError` if the native runner cannot run the model.
    Returns the bytes no longer referenced by anything (weights the native decoder shares, such as
    the unfused float32 ``o_proj``, stay alive through it and are not counted).
    """
    runner = runner_for(model, "native")
    held = set()
    for layer in runner.decoder.layers:
        for part in vars(layer).values():
            for t in (getattr(part, "weight", None), getattr(part, "bias", None)):
                if isinstance(t, torch.Tensor):
                    held.add(t.untyped_storage().data_ptr())
    freed = 0
    for hf_layer in model.model.layers:
        for module in hf_layer.modules():
            if not isinstance(module, torch.nn.Linear) or module.weight.device.type == "meta":
                continue
            for name in ("weight", "bias"):
                t = getattr(module, name)
                if t is None:
                    continue
                if t.untyped_storage().data_ptr() not in held:
                    freed += t.numel() * t.element_size()
                setattr(module, name, torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False))
    model.__dict__[_RELEASED] = True
    return freed
