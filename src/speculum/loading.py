"""``speculum.load``: a model and its tokenizer, with the weights in the form asked for.

``weights`` picks what the model *is*:

- ``gguf``: a GGUF file's own quantization, kept (:mod:`speculum.weights.gguf_load`); the matrices run
  on speculum's quantized kernels, which round the activations to 8 bits per block of 32 as llama.cpp
  does, so a step reads about as many bytes as llama.cpp's and computes as it does;
- ``float``: the weights dequantized to ``dtype`` (what transformers loads);
- ``int8`` / ``int4``: a float model quantized at load time (:mod:`speculum.weights.quantize_model`);
- ``auto`` (the default): ``gguf`` for a GGUF file on a CPU whose architecture the native runner runs,
  else ``float``.

Quantized weights make another model than the float one: speculative decoding then reproduces *its*
greedy output (token for token) and its sampling distribution, which differ from the float model's.
Such a model runs on the native runner only (the ``hf`` methods need ``float``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import SpeculumError
from .models import load_float, load_tokenizer_and_config, parse_dtype, resolve
from .process_memory import return_freed_memory
from .runners.decoder import unsupported_reason

WEIGHT_CHOICES = ("auto", "gguf", "float", "int8", "int4")


def resolve_weights(model: str, weights: str | None = None, device: str | None = None, config=None) -> str:
    """What ``weights`` (default ``auto``) means for ``model`` on ``device``: one of ``gguf``,
    ``float``, ``int8``, ``int4`` (module docstring); a :class:`SpeculumError` for a choice that
    cannot apply. ``config``: the model's configuration, where the caller has read it already."""
    from .models import default_device

    device = str(device or default_device())
    weights = (weights or "auto").lower()
    if weights not in WEIGHT_CHOICES:
        raise SpeculumError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    kind, _ = resolve(model)
    cpu = device.startswith("cpu")
    reason = lambda: unsupported_reason(config if config is not None else load_tokenizer_and_config(model)[1])
    if weights == "auto":
        return "float" if kind != "gguf" or not cpu or reason() else "gguf"
    if weights == "float":
        return weights
    if weights == "gguf" and kind != "gguf":
        raise SpeculumError(f"--weights gguf keeps a GGUF file's quantization, and {model!r} is not a GGUF "
                            "file; quantize a float model with --weights int8 or int4")
    if not cpu:
        raise SpeculumError(f"--weights {weights} runs on CPUs only (the quantized kernels are CPU code); "
                            f"use --weights float on {device}")
    why = reason()
    if why:
        raise SpeculumError(f"--weights {weights} needs the native runner, which does not support {why}; "
                            "use --weights float")
    return weights


def load(model: str = "default", dtype: str | torch.dtype | None = None, device: str | None = None,
         tokenizer=None, weights: str | None = None):
    """Load ``(model, tokenizer)`` in eval mode.

    Args:
        model: an alias (``default``, ``gemma3``), a ``.gguf`` path, a local HF directory or a hub id.
        dtype: the activations' (and float weights') dtype: ``"auto"`` (default: float32 with quantized
            weights, whose kernels compute in float32; else :func:`~speculum.models.default_dtype`),
            ``"bfloat16"``, ``"float32"``, ``"float16"`` or a ``torch.dtype``.
        device: ``"cpu"``, ``"cuda"``, ...; default: CUDA when available, else CPU.
        tokenizer: this model's tokenizer, if already loaded.
        weights: ``"auto"``, ``"gguf"``, ``"float"``, ``"int8"`` or ``"int4"`` (module docstring).
    """
    tok = config = None
    if resolve(model)[0] == "gguf":  # read once: resolve_weights and the GGUF loader both need it
        tok, config = load_tokenizer_and_config(model)
    weights = resolve_weights(model, weights, device, config)
    auto = dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto")
    torch_dtype = torch.float32 if auto else parse_dtype(dtype)  # quantized weights' kernels compute in float32
    if weights == "float":
        lm, tokenizer = load_float(model, dtype, device, tokenizer)
    elif weights == "gguf":
        from .weights.gguf_load import load_gguf_quantized

        try:
            lm, quant = load_gguf_quantized(Path(resolve(model)[1]), config, torch_dtype)
        except (ValueError, NotImplementedError) as e:
            raise SpeculumError(f"could not load {model!r} with its GGUF weights: {e}; try --weights float") \
                from None
        lm.speculum_quant = quant
        tokenizer = tokenizer or tok
        return_freed_memory()  # the conversion's and the file reader's temporaries
    else:
        from .weights.quantize_model import quantize_model

        lm, tokenizer = load_float(model, torch_dtype, "cpu", tokenizer)
        quantize_model(lm, weights)
    lm.eval()
    lm.requires_grad_(False)
    lm.speculum_name = model
    lm.speculum_weights = weights
    return lm, tokenizer
