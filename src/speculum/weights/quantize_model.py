"""``--weights int8|int4``: a float model's matrices quantized at load time (a change of model, not of
decoding: speculative output then equals the *quantized* model's greedy output).

- ``int8``: every decoder matrix, the embedding and the LM head to Q8_0 (8 bits and a scale per 32);
- ``int4``: the decoder matrices to Q4_1 (4 bits, a scale and a minimum per 32), the embedding and
  head to Q8_0, as llama.cpp's 4-bit files keep their output layer at higher precision.

Matrices whose input width is not a multiple of 32 stay float. The quantized tensors replace the
float ones (which become meta tensors), as :mod:`speculum.weights.gguf_load` leaves a GGUF model.
"""

from __future__ import annotations

import torch

from .formats import quantize

LAYER_FORMAT = {"int8": "Q8_0", "int4": "Q4_1"}
TABLE_FORMAT = "Q8_0"  # embedding and LM head


@torch.no_grad()
def quantize_model(model: torch.nn.Module, weights: str) -> dict:
    """Quantize ``model``'s decoder-layer linear weights, embedding and head in place (``weights``:
    ``int8`` or ``int4``); sets and returns ``model.speculum_quant``."""
    if weights not in LAYER_FORMAT:
        raise ValueError(f"weights must be int8 or int4, not {weights!r}")
    quant, seen = {}, set()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.dim() != 2 or param.shape[1] % 32 or param.device.type == "meta":
            continue
        if param is embed or param is head:
            fmt = TABLE_FORMAT
        elif ".layers." in name and name.endswith(".weight") and "norm" not in name:
            fmt = LAYER_FORMAT[weights]
        else:
            continue
        if id(param) in seen:
            continue  # tied: the first name's entry (the embedding's) serves both
        seen.add(id(param))
        quant[name] = quantize(param, fmt)
    for name in quant:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=False))
    if head is embed:
        model.tie_weights()
    model.speculum_quant = quant
    return quant
