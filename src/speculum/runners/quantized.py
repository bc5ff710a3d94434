"""Weight-only quantized copies of a native decoder's linear layers, for a quantized self-draft.

- ``int8``: one scale per output channel, symmetric; runs ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: groups of :data:`GROUP` input channels, asymmetric (a scale and a minimum per group);
  runs ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on oneDNN's packed layout (the gpt-fast /
  torchao CPU kernels).

Activations stay in the model's dtype. Where the kernels do not apply (another device, a shape the
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

from .decoder import Layer, Linear, NativeDecoder

GROUP = 32  # int4 group size along the input channels
QUANT_BITS = (4, 8)
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> {bits: (layers, head)}


def linear_weight(linear: Linear) -> torch.Tensor:
    """The weight ``[out, in]`` of a native :class:`Linear`, read back from its oneDNN-packed copy
    where the plain weight was dropped: the identity times ``W^T`` is exact; a layer with a bias
    adds it inside the kernel, so subtracting it back is exact only to the weight's rounding (far
    below what quantizing then loses)."""
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


def _quantize(linear: Linear, bits: int) -> QuantLinear:
    bias = None if linear.bias is None else linear.bias.detach()
    return QuantLinear(linear_weight(linear), bias, bits)


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
            layers.append(q)
        copies[bits] = layers, _quantize(decoder.head, bits)
    return copies[bits]
