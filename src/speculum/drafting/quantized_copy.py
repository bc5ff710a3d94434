"""Weight-only quantized copies of a native decoder's linear layers, for a quantized self-draft.

- ``int8``: one scale per output channel, symmetric; runs ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: groups of :data:`GROUP` input channels, asymmetric (a scale and a minimum per group);
  runs ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on oneDNN's packed layout (the gpt-fast /
  torchao CPU kernels).

Activations stay in the model's dtype. The copies' norms run as one kernel each (:class:`DraftNorm`),
and a draft's LM head can cover part of the vocabulary only (:class:`TrimmedHead`): what is
cheap for a draft, whose numbers only propose. Where the kernels do not apply (another device, a shape the
int4 packing refuses) the layer runs the dequantized weights through ``F.linear``: the same
numbers, without the saving. The source weights are read back from the decoder itself, so a
model whose transformers weights were released (:func:`~speculum.runners.release_model_weights`)
can still be quantized.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F

from ..runners.decoder import Layer, Linear, NativeDecoder, RMSNorm

GROUP = 32  # int4 group size along the input channels
QUANT_BITS = (4, 8)
# decoder -> {bits: (layers, head)} and {"head": the head's weight read back (an untied head)}
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def linear_weight(linear: Linear) -> torch.Tensor:
    """The weight ``[out, in]`` of a native :class:`Linear`, read back from its oneDNN-packed copy
    where the plain weight was dropped: the identity times ``W^T`` is exact; a layer with a bias
    adds it inside the kernel, so subtracting it back is exact only to the weight's rounding (far
    below what quantizing then loses)."""
    from ..weights import QuantWeight, StackedLinear

    if isinstance(linear, StackedLinear):  # quantized parts: their dequantized values, stacked
        return torch.cat([linear_weight(part) for part in linear.parts])
    if isinstance(linear.weight, QuantWeight):  # already quantized (a GGUF model): its dequantized values
        return linear.weight.dequantize()
    if linear.weight is not None:
        return linear.weight.detach()
    eye = torch.eye(linear.in_features, dtype=linear.dtype)
    out = linear.packed(eye)  # [in, out] = I W^T + b
    if linear.bias is not None:
        out = out - linear.bias
    return out.t().contiguous()


class QuantLinear:
    """``y = x W^T + b`` with ``W`` quantized to ``bits`` (4 or 8); the :class:`Linear` call signature."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int):
        if bits not in QUANT_BITS:
            raise ValueError(f"weight quantization is to {QUANT_BITS} bits, not {bits}")
        out_f, in_f = weight.shape
        self.bias, self.bits, self.in_features = bias, bits, in_f
        dtype, w = weight.dtype, weight.float()
        self.kernel = None
        if bits == 8:
            scale = (w.abs().amax(1) / 127).clamp(min=1e-8)  # [out]
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.dequantized = (q.float() * scale[:, None]).to(dtype)
            if weight.device.type == "cpu":
                scales = scale.to(dtype)
                self.kernel = lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)
        else:
            groups = w.view(out_f, -1, GROUP) if in_f % GROUP == 0 else None
            if groups is None:  # no whole groups: one group per row
                groups = w.view(out_f, 1, in_f)
            lo, hi = groups.amin(-1), groups.amax(-1)  # [out, in/G]
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
            self.dequantized = (q * scale[..., None] + lo[..., None]).view(out_f, in_f).to(dtype)
            if weight.device.type == "cpu" and in_f % GROUP == 0 and out_f % 16 == 0:
                # the kernel computes (q - 8) * scale + zero per group: zero = lo + 8 * scale
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(out_f, in_f), 1)
                scale_zero = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype)
                self.kernel = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)
        if self.kernel is not None:
            self.dequantized = None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """``x [n, in]`` -> ``[n, out]`` (``min_rows`` is ignored: drafts need no row floor)."""
        if self.kernel is None:
            return F.linear(x, self.dequantized, self.bias)
        y = self.kernel(x.contiguous())
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        """Bytes of the quantized weight (what a step reads)."""
        return self.dequantized.numel() * self.dequantized.element_size() if self.kernel is None else 0


class DraftNorm:
    """An :class:`~speculum.runners.decoder.RMSNorm` as one kernel, for a draft's layers:
    ``x / rms(x) * w`` is layer normalization over ``[x, -x]`` (mean zero, variance ``mean(x^2)``)
    with the weight ``[w, 0]``, the first half kept. On a CPU ``F.rms_norm`` runs as several
    kernels, and a draft forward has one norm per layer and a half. Rounded differently from the target's norm: a draft's numbers only
    propose. ``x [..., D]`` -> ``[..., D]`` (a view into a ``[..., 2D]`` result)."""

    def __init__(self, norm: RMSNorm):
        w = norm.fused_weight  # Gemma's 1 + w already folded in
        self.width, self.eps = w.shape[0], norm.eps
        self.weight = torch.cat([w, torch.zeros_like(w)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        both = torch.cat([x, -x], dim=-1)
        return F.layer_norm(both, (2 * self.width,), self.weight.to(x.dtype), None, self.eps)[..., :self.width]


NORMS = ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")  # a Layer's


def head_weight(decoder: NativeDecoder) -> torch.Tensor:
    """The LM head's weight ``[V, D]``: the embedding table where they are tied, else read back
    from the packed head once per decoder (kept: a trimmed head reads rows of it per request)."""
    if decoder.tied_head is not None:
        return decoder.tied_head
    copies = _COPIES.setdefault(decoder, {})
    if "head" not in copies:
        copies["head"] = linear_weight(decoder.head)
    return copies["head"]


class TrimmedHead:
    """A quantized draft LM head over part of the vocabulary (FR-Spec, Zhao et al. 2025; VocabTrim):
    ``[n, D]`` final-norm output -> ``[n, V]`` logits, ``-inf`` outside ``vocab``.

    ``vocab [K]`` token ids (the frequent ones: a shipped head's draft vocabulary) are quantized
    once; :meth:`with_tokens` adds a request's own tokens (its prompt, which long-context answers
    copy) in a second, small product: a draft forward's head costs in proportion to the tokens it
    covers. The draft proposes only tokens it covers;
    the target's verification keeps the output exact (and a sampled draft's ``q`` is zero
    elsewhere, as the verifier expects).
    """

    def __init__(self, decoder: NativeDecoder, bits: int, vocab: torch.Tensor):
        self.decoder, self.bits, self.width = decoder, bits, decoder.shape.vocab
        self.vocab = torch.unique(vocab.to(torch.int64).cpu())
        if not len(self.vocab) or int(self.vocab[0]) < 0 or int(self.vocab[-1]) >= self.width:
            raise ValueError(f"a trimmed head needs token ids in 0 .. {self.width - 1}")
        self.base = QuantLinear(_rows(head_weight(decoder), self.vocab), None, bits)
        self.extra: QuantLinear | None = None
        self.ids = _padded(self.vocab).to(decoder.device)  # the logits' columns, in product order

    def with_tokens(self, tokens) -> TrimmedHead:
        """A copy that also covers ``tokens`` (any iterable of ids; those outside the vocabulary's
        width are ignored). Costs a quantization of the new rows (a few ms for a few thousand)."""
        new = torch.unique(torch.tensor(list(tokens), dtype=torch.int64))
        new = new[(new >= 0) & (new < self.width) & ~torch.isin(new, self.vocab)]
        twin = copy.copy(self)
        twin.extra = QuantLinear(_rows(head_weight(self.decoder), new), None, self.bits) if len(new) else None
        twin.ids = torch.cat([_padded(self.vocab), _padded(new)]).to(self.decoder.device) if len(new) else self.ids
        return twin

    def covers(self) -> int:
        """How many tokens the head scores."""
        return int(torch.unique(self.ids).numel())

    def __call__(self, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        part = self.base(x)
        if self.extra is not None:
            part = torch.cat([part, self.extra(x)], dim=-1)
        out = torch.full((x.shape[0], self.width), float("-inf"), dtype=part.dtype, device=part.device)
        return out.index_copy_(1, self.ids, part)


def _padded(ids: torch.Tensor) -> torch.Tensor:
    """``ids [k]`` with the last repeated up to a multiple of 16 (the int4 kernel's row multiple;
    a repeated row writes the same logit twice)."""
    pad = -len(ids) % 16
    return torch.cat([ids, ids[-1:].expand(pad)]) if pad and len(ids) else ids


def _rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``weight [V, D]`` (padded as :func:`_padded`), to quantize."""
    return weight.index_select(0, _padded(ids).to(weight.device))


def _quantize(linear: Linear, bits: int) -> QuantLinear:
    bias = None if linear.bias is None else linear.bias.detach()
    return QuantLinear(linear_weight(linear), bias, bits)


def weights_already_quantized(decoder: NativeDecoder) -> bool:
    """Whether ``decoder``'s layers already run quantized weights (a GGUF model kept quantized): its
    own kernels then stream fewer bytes than a torch int4/int8 copy's would, so a self-draft is
    cheapest on the target's own weights."""
    from ..weights import QuantizedLinear, StackedLinear

    return isinstance(decoder.layers[0].gate_up, (QuantizedLinear, StackedLinear))


def quantized_layers(decoder: NativeDecoder, bits: int) -> list[Layer]:
    """Copies of ``decoder.layers`` whose four linear layers are quantized to ``bits`` (norms shared);
    made once per decoder and width."""
    return _copy(decoder, bits)[0]


def quantized_head(decoder: NativeDecoder, bits: int) -> QuantLinear:
    """The LM head quantized to ``bits`` (``[n, D]`` final-norm output -> ``[n, V]``); made once per
    decoder and width."""
    return _copy(decoder, bits)[1]


@torch.inference_mode()
def _copy(decoder: NativeDecoder, bits: int) -> tuple[list[Layer], QuantLinear]:
    copies = _COPIES.setdefault(decoder, {})
    if bits not in copies:
        layers = []
        for layer in decoder.layers:
            q = copy.copy(layer)
            q.qkv, q.o = _quantize(layer.qkv, bits), _quantize(layer.o, bits)
            q.gate_up, q.down = _quantize(layer.gate_up, bits), _quantize(layer.down, bits)
            for name in NORMS:
                if getattr(layer, name) is not None:
                    setattr(q, name, DraftNorm(getattr(layer, name)))
            layers.append(q)
        copies[bits] = layers, _quantize(decoder.head, bits)
    return copies[bits]
