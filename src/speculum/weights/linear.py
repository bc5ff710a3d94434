"""Linear layers and embedding tables on block-quantized weights (:class:`~speculum.weights.formats.QuantWeight`).

:class:`QuantizedLinear` has the call of the native decoder's float ``Linear`` (``x [n, in], min_rows``
-> ``[n, out]``), so the decoder does not know which it holds. It runs the compiled kernels
(:mod:`speculum.weights.build`), which round each activation row to 8 bits per block of 32 as
llama.cpp does and multiply codes in integers (a product within ``d/2 * sum|w|`` per block of the
float product, ``d`` the block's activation scale). Every row is rounded and computed alone, so a
row's result does not depend on how many rows share the call and the reproducible mode needs no
padding (``min_rows`` is ignored); prompt chunks run the same kernels. Where the kernels cannot be
built, the layer runs ``F.linear`` on the weight dequantized to float once (float activations: the
same weights, another rounding).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .build import kernels
from .formats import QuantWeight

_DENSE: dict[int, torch.Tensor] = {}  # id(QuantWeight) -> its dequantized values, while it lives


def dense(weight: QuantWeight) -> torch.Tensor:
    """``weight`` dequantized to float32, once: every caller gets the same tensor (read-only by
    convention), freed with the weight."""
    key = id(weight)
    out = _DENSE.get(key)
    if out is None:
        out = _DENSE[key] = weight.dequantize()
        weakref.finalize(weight, _DENSE.pop, key, None)
    return out


class QuantizedLinear:
    """``y = x W^T + b`` for a quantized ``W [out, in]``; ``x [n, in]`` -> ``[n, out]`` in ``x``'s dtype."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.dtype = torch.float32  # what the kernels compute in
        self.packed = None  # (the float Linear's attribute: no oneDNN copy here)
        self._kernels = kernels()
        self.args = weight.kernel_args()  # the kernels' weight arguments (a fused MLP passes them on)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight a product reads."""
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._kernels is None:
            y = F.linear(x2.float(), dense(self.weight))
        else:
            y = self._kernels.qlinear(x2, *self.args)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class QuantizedEmbedding:
    """Rows of a quantized table ``[V, D]`` by token id: ``ids [n]`` -> ``[n, D]`` float32, dequantized
    on the fly (a tied LM head and its embedding share the one table)."""

    def __init__(self, weight: QuantWeight):
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self._kernels = kernels()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        if self._kernels is None:
            rows = self.weight.dequantize(flat)
        else:
            rows = self._kernels.dequant_rows(flat.cpu(), *self.weight.kernel_args())
        return rows.to(ids.device).reshape(*ids.shape, self.embedding_dim)
