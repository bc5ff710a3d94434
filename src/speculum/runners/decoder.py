"""A compact decoder for Llama-family and Gemma-3 weights: the whole forward pass in one file.

Supported: Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM (RMSNorm, rotary positions with the static
scaling variants, grouped-query attention, SwiGLU, tied or untied head, optional QKV bias and
per-head q/k norms) and Gemma-3 text models (sliding-window and global layers with their own
rotary bases, ``1 + w`` norms computed in float32, sandwich norms around attention and MLP,
GeGLU, scaled embeddings, attention and final-logit soft-capping where configured).

Weights come from a loaded transformers model (so every source ``speculum.load`` reads, HF
directories and GGUF, works) and are re-laid out once: Q, K and V become one ``[(H + 2 H_kv) d,
D]`` matrix, gate and up one ``[2 F, D]`` matrix, so a layer runs four matrix products. The
arithmetic follows transformers' modules op for op (same dtypes at each step), which is what
keeps float32 greedy output token-identical to the Hugging Face runner.

Shapes use ``n`` new tokens, ``D`` hidden size, ``H`` query heads, ``H_kv`` KV heads, ``g = H /
H_kv``, ``d`` head dim, ``C`` cache capacity and ``L`` visible key slots. There is no batch axis:
a batch of sequences is one forward over their tokens laid end to end, each attending its own cache
(:mod:`speculum.runners.batched`).

The attention itself (masks, grouped-query folding, rotary embedding) is :mod:`speculum.attention`'s;
where keys and values are stored is the caller's (:meth:`NativeDecoder.forward_with`'s
:class:`~speculum.cache.store.KVStore`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..attention import AttentionLayout, Rotary, attention, capacity_span, rotate, rotate_fused, span_mask
from ..cache.store import BufferStore, KVStore
from .base import Forward, layer_types
from .invariance import NO_FLOORS, RowFloors
from .packed import packed_linear

LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}
GEMMA3 = {"gemma3_text"}
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}  # inv_freq fixed for all lengths
# steps of up to this many rows attend through the compiled layer ops (longer prompt chunks take torch's
# attention, whose blocked kernels are faster there), and every verification step up to OPS_VERIFY_ROWS
# (a tree with a drafter's prompt rows): its rows must come out as one-token steps would compute them,
# bit for bit, since with 8-bit activations a last-bit difference can move a code and then a token
OPS_ATTENTION_ROWS = 64
OPS_VERIFY_ROWS = 256
_EMPTY = torch.empty(0)


def layer_ops():
    """The compiled layer ops (:mod:`speculum.weights.build`), or None where they cannot be built or
    ``SPECULUM_LAYER_OPS=0``."""
    if os.environ.get("SPECULUM_LAYER_OPS", "1") == "0":
        return None
    from ..weights.build import kernels

    return kernels()


def unsupported_reason(config) -> str | None:
    """Why the native decoder cannot run ``config`` (None when it can)."""
    mt = getattr(config, "model_type", "")
    if mt not in LLAMA_FAMILY | GEMMA3:
        return f"architecture {mt!r} (native: {', '.join(sorted(LLAMA_FAMILY | GEMMA3))})"
    for params in _rope_parameters(config).values():
        rtype = (params or {}).get("rope_type", "default")
        if rtype not in STATIC_ROPE_TYPES:
            return f"rope type {rtype!r}"
    if mt == "smollm3" and any(not x for x in getattr(config, "no_rope_layers", [1])):
        return "layers without rotary positions (SmolLM3 NoPE)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def _rope_parameters(config) -> dict:
    """``{layer_type: rope params}``; transformers 5 keeps either one dict or one per layer type."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    if "rope_type" in params or "rope_theta" in params:
        return {"full_attention": params, "sliding_attention": params}
    return params


@dataclass
class DecoderShape:
    """The numbers a forward pass needs, read from a transformers config."""

    family: str  # "llama" | "gemma3"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    act: str
    attn_scale: float
    sliding_window: int | None
    attn_softcap: float | None
    final_softcap: float | None

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


class Linear:
    """``y = x W^T + b`` for ``x [n, in]``; bfloat16 and float32 CPU weights run prepacked by oneDNN
    (:func:`~speculum.runners.packed.packed_linear`), which then replaces the plain weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias  # [out, in], [out]
        self.in_features, self.dtype = weight.shape[1], weight.dtype
        self.packed = packed_linear(weight, bias)
        if self.packed is not None:
            self.weight = None  # the packed copy replaces it (frees the fused QKV / gate-up copies)

    def __call__(self, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """``x [n, in]`` -> ``[n, out]``, computed over at least ``min_rows`` rows (the first row
        repeated as padding, then dropped): the reproducible mode's row floor
        (:mod:`speculum.runners.invariance`)."""
        n = x.shape[0]
        if n < min_rows:
            return self(torch.cat([x, x[:1].expand(min_rows - n, -1)]))[:n]
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class RMSNorm:
    """transformers' RMSNorm: Llama scales after casting back (``w * norm(x).to(dtype)``), Gemma in
    float32 with ``1 + w`` (``(norm(x) * (1 + w)).to(dtype)``).

    ``fused=True`` runs one ``F.rms_norm`` kernel instead (the GPU path, where each small kernel
    costs a launch): the same function, rounded differently in low precision.
    """

    def __init__(self, weight: torch.Tensor, eps: float, gemma: bool, fused: bool = False):
        self.eps, self.gemma, self.fused = eps, gemma, fused
        self.scale = (1.0 + weight.float()) if gemma else weight
        self.fused_weight = self.scale.to(weight.dtype)
        self.shape = (weight.shape[0],)
        self.scale32 = self.scale.float().contiguous()  # the compiled layer ops' operand

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, self.shape, self.fused_weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * self.scale).type_as(x)
        return self.scale * h.to(x.dtype)


class Layer:
    """One decoder layer's weights. ``quant``: the model's quantized matrices by parameter name
    (``model.speculum_quant``, :mod:`speculum.weights`), ``prefix`` this layer's name in it; the
    matrices found there run on the quantized kernels, the others as float :class:`Linear`."""

    def __init__(self, hf_layer, shape: DecoderShape, sliding: bool, fused: bool, quant: dict | None = None,
                 prefix: str = ""):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        gemma = shape.family == "gemma3"
        self.sliding = sliding
        linear = lambda parts, names: _linear(parts, [prefix + n for n in names], quant or {})
        self.qkv = linear([attn.q_proj, attn.k_proj, attn.v_proj],
                          ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
        self.o = linear([attn.o_proj], ["self_attn.o_proj"])
        self.gate_up = linear([mlp.gate_proj, mlp.up_proj], ["mlp.gate_proj", "mlp.up_proj"])
        self.down = linear([mlp.down_proj], ["mlp.down_proj"])
        norm = lambda m: None if m is None else RMSNorm(m.weight.detach(), _eps(m), gemma, fused)
        self.q_norm = norm(getattr(attn, "q_norm", None))
        self.k_norm = norm(getattr(attn, "k_norm", None))
        self.input_norm = norm(hf_layer.input_layernorm)
        self.post_attn_norm = norm(hf_layer.post_attention_layernorm)
        self.pre_mlp_norm = norm(getattr(hf_layer, "pre_feedforward_layernorm", None))
        self.post_mlp_norm = norm(getattr(hf_layer, "post_feedforward_layernorm", None))


def _linear(modules: list, names: list[str], quant: dict):
    """One linear layer over ``modules``' outputs stacked (a fused QKV or gate-up): quantized where
    ``quant`` holds every part's weight (``names``: their parameter names without ``.weight``), else a
    float :class:`Linear` on the concatenated weights."""
    biases = [m.bias for m in modules]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    keys = [n + ".weight" for n in names]
    if all(k in quant for k in keys):
        from ..weights import quantized_linear

        return quantized_linear([quant[k] for k in keys], bias)
    weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
    return Linear(weight, bias)


def _eps(norm_module) -> float:
    return norm_module.variance_epsilon if hasattr(norm_module, "variance_epsilon") else norm_module.eps


class NativeDecoder:
    """The forward pass over a static KV buffer.

    Build with :meth:`from_hf`; call :meth:`forward`. Weights are shared with (or, for the fused
    matrices, copied once from) the transformers model, which stays usable.

    ``fused`` trades op-for-op fidelity to transformers for fewer kernels: one-kernel RMSNorm,
    rotary embedding on queries and keys together in three kernels, keys and values written in
    one copy. A small model's step is bound by kernel launches on a GPU, and the CPU gains a little
    too (BENCHMARKS.md, native runner); float32 on the CPU keeps the exact path, bit-identical to
    the Hugging Face runner.
    """

    def __init__(self, shape: DecoderShape, embed, embed_scale: torch.Tensor | None,
                 layers: list[Layer], final_norm: RMSNorm, head: Linear, rotary: dict[str, Rotary],
                 fused: bool = False, dtype: torch.dtype | None = None):
        self.shape, self.embed, self.embed_scale = shape, embed, embed_scale
        self.layers, self.final_norm, self.head, self.rotary = layers, final_norm, head, rotary
        self.fused = fused
        # the LM head's weight ``[V, D]`` where it is the embedding table (tied), for code that reads
        # rows of it (a trimmed draft head); None where the head has weights of its own or is quantized
        self.tied_head: torch.Tensor | None = None
        self.act = ACT2FN[shape.act]
        # the compiled MLP (layer_ops.cpp) computes these activations: whether it is GELU's tanh form
        self.mlp_gelu = {"silu": False, "gelu_pytorch_tanh": True}.get(shape.act)
        self._compiled: dict[int, tuple] = {}  # layer index -> (its Layer, its compiled form or None)
        # ``embed``: the table ``[V, D]``, or a quantized one (:class:`~speculum.weights.QuantizedEmbedding`)
        self.quantized = not isinstance(embed, torch.Tensor)
        self.dtype = dtype or embed.dtype
        self.device = torch.device("cpu") if self.quantized else embed.device
        # the compiled glue between the quantized products (norms, rotary, attention over the cache:
        # speculum/weights/layer_ops.cpp), which computes every row alone; None runs torch's operators
        quantized_layers = any(not isinstance(layer.qkv, Linear) for layer in layers)
        self.ops = layer_ops() if quantized_layers and self.dtype == torch.float32 and not fused else None
        # what the step's cost depends on beyond the configuration (the calibration key's part): the
        # quantized kernels' build (their source and this CPU) and options
        self.kernel_variant = ""
        if quantized_layers:
            from ..weights.build import build_key, target_arch

            self.kernel_variant = (f" kernels={build_key(target_arch())}"
                                   + ("" if self.ops is not None else " torch-ops"))
        self.layout = AttentionLayout(
            layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
            scale=shape.attn_scale, softcap=shape.attn_softcap, window=shape.sliding_window,
            sliding=tuple(layer.sliding for layer in layers),
            rotary=tuple(rotary["sliding_attention" if layer.sliding else "full_attention"] for layer in layers))

    @classmethod
    @torch.inference_mode()
    def from_hf(cls, model: torch.nn.Module, fused: bool | None = None) -> NativeDecoder:
        """Re-lay out a transformers ``*ForCausalLM``'s weights (raises ValueError if unsupported).

        ``fused=None``: on CUDA devices and for low-precision weights, unless
        ``SPECULUM_NATIVE_FUSED=0``; float32 on the CPU keeps the exact path (the reference).
        """
        cfg = model.config
        reason = unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"the native runner does not support {reason}")
        gemma = cfg.model_type in GEMMA3
        quant = getattr(model, "speculum_quant", None) or {}
        base = model.model
        if quant:
            from ..weights import model_dtype

            dtype = model_dtype(model)
        else:
            dtype = model.get_output_embeddings().weight.dtype
        if fused is None:
            w = model.get_output_embeddings().weight
            fused = ((w.device.type == "cuda" or dtype != torch.float32)
                     and os.environ.get("SPECULUM_NATIVE_FUSED", "1") != "0")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        types = layer_types(cfg)
        window = getattr(cfg, "sliding_window", None)
        sliding = [t == "sliding_attention" and window is not None for t in types]
        shape = DecoderShape(
            family="gemma3" if gemma else "llama",
            vocab=model.get_output_embeddings().weight.shape[0],
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            act=getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
            attn_scale=(cfg.query_pre_attn_scalar ** -0.5) if gemma else head_dim ** -0.5,
            sliding_window=window if any(sliding) else None,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
            final_softcap=getattr(cfg, "final_logit_softcapping", None),
        )
        embed = base.embed_tokens.weight.detach()
        scale = getattr(base.embed_tokens, "embed_scale", None)
        embed_scale = None if scale is None else scale.to(dtype)
        layers = [Layer(hf_layer, shape, s, fused, quant, f"model.layers.{i}.")
                  for i, (hf_layer, s) in enumerate(zip(base.layers, sliding))]
        final_norm = RMSNorm(base.norm.weight.detach(), _eps(base.norm), gemma, fused)
        head_weight = model.get_output_embeddings().weight
        tied = head_weight is base.embed_tokens.weight or (
            head_weight.device.type != "meta" and head_weight.data_ptr() == base.embed_tokens.weight.data_ptr())
        embed_key, head_key = "model.embed_tokens.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"
        if embed_key in quant:
            from ..weights import QuantizedEmbedding

            embed = QuantizedEmbedding(quant[embed_key])
        if head_key in quant:
            from ..weights import quantized_linear

            head = quantized_linear([quant[head_key]])
        else:
            head = Linear(head_weight.detach())
        rotary = {}
        for kind in set(types):
            emb = base.rotary_emb
            inv = getattr(emb, f"{kind}_inv_freq", None)
            if inv is None:  # one rotary for every layer (Llama family)
                rotary[kind] = Rotary(emb.inv_freq, emb.attention_scaling)
            else:
                rotary[kind] = Rotary(inv, getattr(emb, f"{kind}_attention_scaling"))
        decoder = cls(shape, embed, embed_scale, layers, final_norm, head, rotary, fused, dtype)
        if tied and isinstance(embed, torch.Tensor):
            decoder.tied_head = embed
        return decoder

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, write: int | torch.Tensor,
                keys: int, masks: dict[bool, torch.Tensor | None], last_only: bool = False,
                hidden_layers: Sequence[int] = (), floors: RowFloors | None = None,
                extra_embeds: torch.Tensor | None = None, window_start: int = 0) -> Forward:
        """Logits for ``n`` new tokens; their keys and values are written into ``kv``.

        Args:
            ids: ``[n]`` token ids.
            positions: ``[n]`` rotary positions.
            kv: ``[layers, 2, H_kv, C, d]`` the cache buffer (slot ``c`` holds position ``c`` for
                committed entries).
            write: first slot of the new entries (they go to ``write .. write+n-1``), or ``[n]``
                slot indices (a tensor, for CUDA-graph capture where the offset is data).
            keys: attend over slots ``0 .. keys-1``.
            masks: ``{sliding: [g*n, keys] additive mask or None}`` for full (False) and
                sliding-window (True) layers; None means every key is visible. Rows are
                ``j*n + i`` for query ``i`` and head ``j`` of a KV group (see
                :func:`~speculum.attention.grouped`).
            last_only: return only the last row's logits (prefill).
            hidden_layers: hidden states to return (see :meth:`forward_with`).
            floors: the reproducible mode (:mod:`speculum.runners.invariance`): each matrix product over
                at least its floor's rows, attention by the explicit path whatever the row count.
            extra_embeds: ``[e, D]`` rows given as input embeddings after the ids' (``n`` counts them).
            window_start: the first slot any query sees on a sliding-window layer (those layers read
                from it on; see :class:`~speculum.cache.store.BufferStore`).
        Returns :class:`~speculum.runners.base.Forward`: ``[n, V]`` logits (``[1, V]`` with ``last_only``).
        """
        n = ids.shape[0] + (0 if extra_embeds is None else extra_embeds.shape[0])
        if capacity_span(keys, kv.shape[3], self.shape.group * n, kv.device):
            # the whole buffer, contiguous, instead of a copied slice; the masked slots change no bit
            # of the explicit path either (measured: SmolLM2 bfloat16, 1-9 rows at 5k keys), so the
            # reproducible mode spans too
            masks = {sliding: span_mask(m, keys, kv.shape[3], self.dtype, kv.device) for sliding, m in masks.items()}
            keys = kv.shape[3]

        # the compiled attention, which computes each row alone, for decode and verification steps
        rowwise = (self.ops is not None and isinstance(write, int)
                   and (n <= OPS_ATTENTION_ROWS or (not last_only and n <= OPS_VERIFY_ROWS))
                   and kv.dtype == torch.float32 and kv.is_contiguous()
                   and all(m is None or (m.dim() == 2 and m.is_contiguous()) for m in masks.values()))
        store = BufferStore(kv, write, keys, masks, self.layout, floors is not None, self.fused,
                            self.ops if rowwise else None, window_start)
        return self.forward_with(ids, positions, store, last_only, hidden_layers, floors or NO_FLOORS,
                                 extra_embeds=extra_embeds)

    def forward_with(self, ids: torch.Tensor, positions: torch.Tensor, store: KVStore, last_only: bool = False,
                     hidden_layers: Sequence[int] = (), floors: RowFloors = NO_FLOORS,
                     logit_rows: torch.Tensor | None = None, extra_embeds: torch.Tensor | None = None) -> Forward:
        """:meth:`forward` over any :class:`~speculum.cache.store.KVStore` (``store``: where each
        layer's new keys and values go and what its queries read; a KV policy's, a slot pool's).

        ``hidden_layers``: ``{i: [n, D]}`` to return, numbered as transformers'
        ``output_hidden_states``: 0 the embeddings, ``i`` the ``i``-th layer's output, ``layers`` the
        final norm's output. ``logit_rows [m]``: compute the logits of these rows only (a batch's
        prefill chunks need their last row's). ``extra_embeds [e, D]``: rows input as embeddings after
        the ids' (a drafter's prompt rows)."""
        hidden: dict[int, torch.Tensor] = {}
        h = self.embed_ids(ids)
        if extra_embeds is not None:
            h = torch.cat((h, extra_embeds.to(h.dtype)))
        if 0 in hidden_layers:
            hidden[0] = h
        rope = self.rope(positions)
        last = len(self.layers)
        for i, layer in enumerate(self.layers):
            h = self.layer_forward(i, layer, h, rope, store, floors)
            if i + 1 in hidden_layers and i + 1 < last:
                hidden[i + 1] = h
        if last in hidden_layers:
            normed = self.norm_final(h)
            hidden[last] = normed
            if logit_rows is not None:
                normed = normed.index_select(0, logit_rows)
            return Forward(self.head_logits(normed[-1:] if last_only else normed, floors.head), hidden)
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        return Forward(self.logits(h[-1:] if last_only else h, floors.head), hidden)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [n]`` -> hidden states ``[n, D]``."""
        h = self.embed(ids).to(self.dtype) if self.quantized else F.embedding(ids, self.embed)
        return h * self.embed_scale if self.embed_scale is not None else h

    def rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer kind: (cos, sin) [n, 1, d]}`` for ``positions [n]`` (sin sign-folded when fused)."""
        rope = {}
        for kind, r in self.rotary.items():
            cos, sin = r.cos_sin(positions, self.dtype)  # [n, 1, d]
            if self.fused:
                half = self.shape.head_dim // 2
                sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            rope[kind] = cos, sin
        return rope

    def layer_forward(self, i: int, layer: Layer, h: torch.Tensor, rope: dict, store: KVStore,
                      floors: RowFloors = NO_FLOORS) -> torch.Tensor:
        """One decoder layer on ``h [n, D]``; ``store`` and ``floors`` as in :meth:`forward_with`
        (``i``: the layer's index in the store)."""
        if self.ops is not None and isinstance(layer.input_norm, RMSNorm):  # (a draft's layers: its own norms)
            return self._layer_ops_forward(i, layer, h, rope, store, floors)
        s = self.shape
        n = h.shape[0]
        cos, sin = rope["sliding_attention" if layer.sliding else "full_attention"]
        x = layer.input_norm(h)
        qkv = layer.qkv(x, floors.qkv).view(n, s.heads + 2 * s.kv_heads, s.head_dim)
        if self.fused:
            q, k, v = self._qkv_fused(layer, qkv, cos, sin)
        else:
            q, k, v = qkv.split([s.heads, s.kv_heads, s.kv_heads], dim=1)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = layer.o(store.attend(i, layer.sliding, q, k, v), floors.o)
        if layer.pre_mlp_norm is not None:  # Gemma: norms on both sides of each block
            h = h + layer.post_attn_norm(a)
            x = layer.pre_mlp_norm(h)
        else:
            h = h + a
            x = layer.post_attn_norm(h)
        gate, up = layer.gate_up(x, floors.gate_up).chunk(2, dim=-1)
        m = layer.down(self.act(gate) * up, floors.down)
        return h + (layer.post_mlp_norm(m) if layer.post_mlp_norm is not None else m)

    def _layer_ops_forward(self, i: int, layer: Layer, h: torch.Tensor, rope: dict, store: KVStore,
                           floors: RowFloors = NO_FLOORS) -> torch.Tensor:
        """:meth:`layer_forward` on the compiled layer ops (quantized weights, float32): the norms with
        their residual adds, and the q/k norms with the rotary embedding, each one call. (``floors``
        pad only the float products a quantized model may keep: the quantized ones need none.)"""
        s, ops = self.shape, self.ops
        cos, sin = rope["sliding_attention" if layer.sliding else "full_attention"]
        compiled = self._compiled_layer(i, layer) if store.compiled is not None else None
        if compiled is not None:
            kv, write, keys, masks = store.compiled
            return compiled.step(h, cos, sin, kv, write, keys, masks[layer.sliding])
        norm = layer.input_norm
        x = ops.rms_norm(h.contiguous(), norm.scale32, norm.eps)
        qkv = _product(ops, layer.qkv, x, floors.qkv)
        qn, kn = layer.q_norm, layer.k_norm
        q, k, v = ops.rope_qkv(qkv, cos, sin, s.heads, s.kv_heads, _EMPTY if qn is None else qn.scale32,
                               _EMPTY if kn is None else kn.scale32, 0.0 if qn is None else qn.eps)
        a = _product(ops, layer.o, store.attend(i, layer.sliding, q, k, v), floors.o)
        if layer.pre_mlp_norm is not None:  # Gemma: norms on both sides of each block
            post, nxt = layer.post_attn_norm, layer.pre_mlp_norm
            h, x = ops.add_rms_norm(h, a, post.scale32, post.eps, nxt.scale32, nxt.eps)
        else:
            nxt = layer.post_attn_norm
            h, x = ops.add_rms_norm(h, a, _EMPTY, 0.0, nxt.scale32, nxt.eps)
        gu, down = layer.gate_up, layer.down
        if self.mlp_gelu is not None and _kernel_args(gu) is not None and _kernel_args(down) is not None:
            m = ops.mlp(x, gu.args, down.args, self.mlp_gelu)  # (quantized products: no row floors)
        else:
            gate, up = gu(x, floors.gate_up).chunk(2, dim=-1)
            m = down(self.act(gate) * up, floors.down)
        post = layer.post_mlp_norm
        h, _ = ops.add_rms_norm(h, m, _EMPTY if post is None else post.scale32, 0.0 if post is None else post.eps,
                                _EMPTY, 0.0)
        return h

    def _compiled_layer(self, i: int, layer: Layer):
        """Layer ``i`` as one compiled call (``layer_ops.cpp`` ``QuantLayer``: the calls of
        :meth:`_layer_ops_forward`, in its order), built on first use; None where a product is not a
        plain quantized one or the activation has no compiled form."""
        held = self._compiled.get(i)
        if held is not None and held[0] is layer:
            return held[1]
        products = (layer.qkv, layer.o, layer.gate_up, layer.down)
        compiled = None
        if self.mlp_gelu is not None and all(_kernel_args(p) is not None for p in products):
            s, qn, kn = self.shape, layer.q_norm, layer.k_norm
            if layer.pre_mlp_norm is not None:  # Gemma: norms on both sides of each block
                post, nxt = layer.post_attn_norm, layer.pre_mlp_norm
                post_scale, post_eps = post.scale32, post.eps
            else:
                nxt, post_scale, post_eps = layer.post_attn_norm, _EMPTY, 0.0
            pm = layer.post_mlp_norm
            compiled = self.ops.QuantLayer(
                layer.input_norm.scale32, layer.input_norm.eps, layer.qkv.args, s.heads, s.kv_heads,
                _EMPTY if qn is None else qn.scale32, _EMPTY if kn is None else kn.scale32,
                0.0 if qn is None else qn.eps, i, s.attn_scale, s.attn_softcap or 0.0, layer.o.args, post_scale,
                nxt.scale32, post_eps, nxt.eps, layer.gate_up.args, layer.down.args, self.mlp_gelu,
                _EMPTY if pm is None else pm.scale32, 0.0 if pm is None else pm.eps)
        self._compiled[i] = (layer, compiled)
        return compiled

    def logits(self, h: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """Final norm, head and soft-capping: ``h [n, D]`` -> ``[n, V]`` (``min_rows``: see :class:`Linear`)."""
        return self.head_logits(self.norm_final(h), min_rows)

    def norm_final(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm of ``h [n, D]`` (on the compiled layer ops where the decoder has them)."""
        if self.ops is not None:
            return self.ops.rms_norm(h.contiguous(), self.final_norm.scale32, self.final_norm.eps)
        return self.final_norm(h)

    def head_logits(self, normed: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """Head and soft-capping of final-norm outputs ``[n, D]`` -> ``[n, V]``."""
        logits = self.head(normed, min_rows)
        if self.shape.final_softcap is not None:
            logits = torch.tanh(logits / self.shape.final_softcap) * self.shape.final_softcap
        return logits

    def _qkv_fused(self, layer: Layer, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """``qkv [n, H + 2 H_kv, d]`` -> roped ``q [n, H, d]``, ``k, v [n, H_kv, d]`` in few kernels."""
        s = self.shape
        qk, v = qkv[:, : s.heads + s.kv_heads], qkv[:, s.heads + s.kv_heads:]
        if layer.q_norm is not None:
            qk = torch.cat((layer.q_norm(qk[:, : s.heads]), layer.k_norm(qk[:, s.heads:])), dim=1)
        qk = rotate_fused(qk, cos, signed_sin)
        return qk[:, : s.heads], qk[:, s.heads:], v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               explicit: bool = False) -> torch.Tensor:
        """``q [n, H, d]`` over ``k, v [H_kv, L, d]`` -> ``[n, H*d]`` with this model's scale and
        soft-capping (:func:`speculum.attention.attention`: folded queries, no repeated KV heads;
        ``explicit`` forces its explicit path)."""
        return attention(q, k, v, mask, self.shape.attn_scale, self.shape.attn_softcap, explicit)


def _kernel_args(linear) -> tuple | None:
    """The compiled kernels' weight arguments of ``linear`` where it is a plain quantized layer (a
    :class:`~speculum.weights.QuantizedLinear` without a bias), else None."""
    args = getattr(linear, "args", None)
    return args if args is not None and linear.bias is None else None


def _product(ops, linear, x: torch.Tensor, min_rows: int) -> torch.Tensor:
    """``linear(x)`` for ``x [n, in]`` float32, straight to the compiled kernels where ``linear`` is a
    plain quantized layer (skipping its wrapper's reshapes and casts)."""
    args = _kernel_args(linear)
    return ops.qlinear(x, *args) if args is not None else linear(x, min_rows)
