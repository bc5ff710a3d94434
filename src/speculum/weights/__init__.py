"""Quantized weights: GGUF's formats run as they are stored, and float models quantized at load time.

- :mod:`~speculum.weights.formats`: :class:`QuantWeight`, the kernels' two layouts, and which GGUF
  format maps onto which;
- :mod:`~speculum.weights.build`: the C++ kernels (``kernels.cpp``), built for this CPU on first use;
- :mod:`~speculum.weights.linear`: :class:`QuantizedLinear` and :class:`QuantizedEmbedding`, what the
  native decoder runs;
- :mod:`~speculum.weights.gguf_load`: a GGUF model whose quantized matrices stay quantized;
- :mod:`~speculum.weights.quantize_model`: ``--weights int8|int4`` for float models.

A model loaded with quantized weights carries them as ``model.speculum_quant`` (``{parameter name:
QuantWeight}``; those parameters are meta tensors in the transformers model) and runs on the native
runner only.
"""

from __future__ import annotations

import torch

from .formats import QuantWeight, cat_rows
from .linear import QuantizedEmbedding, QuantizedLinear, dense


class StackedLinear:
    """Several quantized linear layers whose outputs are concatenated (a fused QKV whose parts are
    stored in layouts that do not stack)."""

    def __init__(self, parts: list[QuantizedLinear]):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.dtype, self.packed = torch.float32, None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def quantized_linear(parts: list[QuantWeight], bias: torch.Tensor | None = None):
    """One linear layer over the stacked outputs of ``parts`` (``bias`` over all of them)."""
    stacked = cat_rows(parts) if len(parts) > 1 else parts[0]
    if stacked is not None:
        return QuantizedLinear(stacked, bias)
    layers = [QuantizedLinear(p) for p in parts]
    if bias is None:
        return StackedLinear(layers)
    start = 0
    for layer in layers:
        layer.bias, start = bias[start:start + layer.out_features], start + layer.out_features
    return StackedLinear(layers)


def quantized_of(model) -> dict[str, QuantWeight]:
    """The model's quantized matrices by parameter name (empty for a float model)."""
    return getattr(model, "speculum_quant", None) or {}


def model_device(model) -> torch.device:
    """Where ``model`` runs: its parameters' device (a quantized model's meta tensors aside: the CPU)."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def model_dtype(model) -> torch.dtype:
    """The dtype ``model`` computes in: its first real parameter's (a quantized model's meta tensors
    aside; float32 where it has none)."""
    return next((p.dtype for p in model.parameters() if p.device.type != "meta"), torch.float32)


def embedder(model):
    """``ids [...]`` -> input embeddings ``[..., D]`` (Gemma's scale included) of ``model``, whose table
    may be quantized."""
    module = model.get_input_embeddings()
    quant = quantized_of(model)
    if "model.embed_tokens.weight" not in quant:
        return module
    table = QuantizedEmbedding(quant["model.embed_tokens.weight"])
    scale = getattr(module, "embed_scale", None)
    dtype = model_dtype(model)
    return lambda ids: table(ids).to(dtype) * (scale.to(dtype) if scale is not None else 1)


def quantized_head(model) -> QuantWeight | None:
    """The LM head's quantized matrix (the embedding's where they are tied), or None."""
    quant = quantized_of(model)
    if "lm_head.weight" in quant:
        return quant["lm_head.weight"]
    if model.get_output_embeddings().weight.device.type == "meta":
        return quant.get("model.embed_tokens.weight")  # tied
    return None


def float_weight(model, name: str) -> torch.Tensor:
    """A parameter of ``model`` as a float tensor: itself, or its quantized matrix dequantized
    (float32; one shared copy, :func:`dense`), for code that needs the values (a learned head's tables)."""
    quant = quantized_of(model)
    if name in quant:
        return dense(quant[name])
    tensor = model.get_parameter(name)
    if tensor.device.type == "meta" and name == "lm_head.weight" and "model.embed_tokens.weight" in quant:
        return dense(quant["model.embed_tokens.weight"])  # tied
    return tensor.detach()


__all__ = ["QuantWeight", "QuantizedEmbedding", "QuantizedLinear", "StackedLinear", "dense", "embedder",
           "float_weight", "model_device", "model_dtype", "quantized_head", "quantized_linear", "quantized_of"]
