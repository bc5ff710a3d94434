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
import mmap
from pathlib import Path

import numpy as np
import torch

from .formats import QuantWeight, from_gguf

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
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)  # GGUF name -> transformers name
    quant: dict[str, QuantWeight] = {}
    for t in reader.tensors:
        name = names.get(t.name)
        if name is None:
            continue
        qtype = t.tensor_type.name
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists the fastest dimension first
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
        _drop_pages(reader, t)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta" and n not in quant]
    tied = getattr(config, "tie_word_embeddings", False) or getattr(config, "tie_embeddings", False)
    if tied:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"{path.name}: no GGUF tensor for {', '.join(missing[:5])}")
    return model, quant


def _drop_pages(reader, tensor) -> None:
    """Let the kernel drop the file pages of ``tensor``'s bytes, now copied: the reader maps the whole
    file, and pages read stay resident until it is closed, so the load's peak memory would hold the
    file and its converted copy at once."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = -(-int(tensor.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor
    end = (int(tensor.data_offset) + int(tensor.n_bytes)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def _row_order(processor, name: str, rows: int) -> torch.Tensor:
    """Which GGUF row each transformers row is (``[rows]``): the processor's permutation applied to row
    indices (the identity for most tensors; Llama's Q and K undo llama.cpp's rotary permutation)."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    moved = np.asarray(processor.process(weights=index, name=name).weights).reshape(rows)
    return torch.from_numpy(moved.copy())
