"""oneDNN-prepacked linear layers on CPUs: bfloat16 where oneDNN has bfloat16 support, and float32.

``torch.ops.mkldnn._linear_pointwise`` on weights reordered once into oneDNN's blocked layout is
several times faster than ``F.linear`` for the 1-64 token inputs that decoding and verification
feed: in bfloat16 always, in float32 above all for 2 or 3 rows, where ``F.linear`` runs a slow
unblocked kernel. BENCHMARKS.md ("Decode core: float32 linears prepacked") has the measurements. The packed copy costs one more copy of
the weights in memory unless it replaces the plain one. ``SPECULUM_PACKED_LINEAR=0`` disables it.
"""

from __future__ import annotations

import os

import torch

from ..models import cpu_runs_bfloat16

# oneDNN's call costs a few microseconds more than F.linear's: in float32 packing pays from about this many
# weights (a 1024 x 256 matrix breaks even; a 576 x 576 one gains for 2+ rows, loses for one)
MIN_FLOAT32_PACKED = 1 << 19


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x [..., in] -> [..., out]`` on oneDNN-prepacked weights for a bfloat16 or float32 CPU linear
    layer, or None where that does not apply (another dtype or device, a torch without oneDNN,
    bfloat16 without oneDNN bfloat16 support, a float32 matrix under :data:`MIN_FLOAT32_PACKED`
    weights, or ``SPECULUM_PACKED_LINEAR=0``). The packed copy is made once, here."""
    if not packs(weight.dtype, weight.device) or (weight.dtype == torch.float32
                                                   and weight.numel() < MIN_FLOAT32_PACKED):
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


def packs(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether :func:`packed_linear` prepacks weights of this dtype on this device."""
    if torch.device(device).type != "cpu" or os.environ.get("SPECULUM_PACKED_LINEAR", "1") == "0":
        return False
    if dtype == torch.bfloat16:
        return cpu_runs_bfloat16()
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def fast_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantized: bool = False):
    """``x [..., in] -> [..., out]`` for drafting-time heads: :func:`packed_linear` where it applies,
    else ``F.linear`` on (detached copies of) these weights. ``quantized``: the weights rounded to
    Q8_0 (8 bits and a scale per 32 inputs) and multiplied by speculum's quantized-weight kernels,
    where they build and ``in`` is a multiple of 32 (a quarter of float32's bytes per product: what
    a head drafting for a GGUF model reads; drafts only, so the output stays the target's)."""
    weight = weight.detach().contiguous()
    bias = None if bias is None else bias.detach()
    if quantized and weight.device.type == "cpu" and weight.shape[1] % 32 == 0:
        from ..weights import QuantizedLinear
        from ..weights.build import kernels
        from ..weights.formats import quantize

        if kernels() is not None:
            return QuantizedLinear(quantize(weight.float(), "Q8_0"), None if bias is None else bias.float())
    packed = packed_linear(weight, bias)
    return packed if packed is not None else (lambda x: torch.nn.functional.linear(x, weight, bias))
