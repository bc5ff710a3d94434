"""A GGUF model with its weights kept in their own quantization (``speculum.load(..., weights="gguf")``).

The transformers model is built on the meta device (no weights) and gets real tensors only where the
GGUF file stores floats (norms): the matrices that GGUF quantizes stay quantized, mapped onto the
kernels' layouts (:mod:`speculum.weights.formats`) and attached as ``model.speculum_quant``
(``{transformers parameter name: QuantWeight}``). Only the native runner runs such a model. Names and
the per-architecture fix-ups (Llama's permuted Q and K rows, Gemma's ``w - 1`` norms) are
transformers' own GGUF mapping; a quantized matrix's rows are permuted as its float rows would be.
Formats without a kernel layout (:data:`~speculum.weights.formats.GGUF_FORMATS` lists those with one)
are dequantized to float, as transformers would.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from .formats import QuantWeight, from_gguf
from .gguf_tensors import GGUFTensors

log = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")


def load_gguf_quantized(path: Path, config, dtype: torch.dtype):
    """``(model, quant)``: a transformers ``*ForCausalLM`` for ``config`` whose float tensors come from
    the GGUF file at ``path`` (in ``dtype``) and whose quantized matrices are meta tensors, and
    ``quant``, those matrices by parameter name."""
    import gguf
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFTensors(path)
    arch = reader.architecture
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = gguf_to_hf_names(model, processor, arch)
    quant: dict[str, QuantWeight] = {}
    for t in reader.tensors:
        name = names.get(t.name)
        if name is None:
            continue
        qtype = t.tensor_type.name
        shape = list(t.shape)
        qw = None
        if qtype not in FLOAT_TYPES and len(shape) == 2:
            qw = from_gguf(t.data, qtype, shape[0], shape[1])
            if qw is None:
                log.info("%s: GGUF type %s has no kernel layout; dequantized to float", t.name, qtype)
        if qw is not None:
            order = _row_order(processor, t.name, shape[0])
            identity = bool(torch.equal(order, torch.arange(shape[0])))
            quant[name] = qw if identity else qw.rows(order)  # (a copy only where rows move: Llama's Q, K)
        else:
            weights = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            weights = processor.process(weights=weights, name=t.name).weights
            set_module_tensor_to_device(model, name, "cpu", value=torch.from_numpy(np.array(weights)).to(dtype))
        reader.drop_pages(t)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta" and n not in quant]
    tied = getattr(config, "tie_word_embeddings", False) or getattr(config, "tie_embeddings", False)
    if tied:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"{path.name}: no GGUF tensor for {', '.join(missing[:5])}")
    return model, quant


def gguf_to_hf_names(model: torch.nn.Module, processor, arch: str) -> dict[str, str]:
    """``{GGUF tensor name: transformers parameter name}`` for ``model``, a ``*ForCausalLM`` of the GGUF
    architecture ``arch``: gguf's standard tensor names, the processor's renaming and fallbacks, as
    transformers' ``get_gguf_hf_weights_map`` maps them for a causal LM (which also walks every
    submodule for checkpoints converted from a base model, rebuilding gguf's name table at each: seconds
    for a 30-layer model, none of it needed here)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise NotImplementedError(f"gguf has no tensor names for architecture {arch!r}")
    table = get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        hf_name = processor.preprocess_name(hf_name)
        stem, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            stem, suffix = hf_name.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = table.get_name(stem)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(names, suffix, "", hf_name)
        else:
            names[gguf_name + suffix] = hf_name
    return names


def _row_order(processor, name: str, rows: int) -> torch.Tensor:
    """Which GGUF row each transformers row is (``[rows]``): the processor's permutation applied to row
    indices (the identity for most tensors; Llama's Q and K undo llama.cpp's rotary permutation)."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    moved = np.asarray(processor.process(weights=index, name=name).weights).reshape(rows)
    return torch.from_numpy(moved.copy())
