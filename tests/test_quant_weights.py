"""Quantized weights: the GGUF formats' layouts, the kernels' accuracy and row independence, and
lossless speculative decoding on quantized tiny models (the packaged models: test_real_models.py).

The kernels keep activations in float32 and decode the weights to float32 in registers, so a product
equals the float product of the dequantized weights up to float32 rounding, which the tests bound by
``1e-5 * sum |x| |w|`` per output.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_gemma3, tiny_llama

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.engine import Engine
from speculum.runners import NativeRunner
from speculum.weights.build import cpu_flags, load_kernels
from speculum.weights.formats import GGUF_FORMATS, QuantWeight, from_gguf, quantize
from speculum.weights.quantize_model import quantize_model

ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32)
# the kernels' variants this machine can run: its own, and on AVX-512 machines the AVX2 and portable code too
ARCHS = ("native", "haswell", "x86-64") if "avx512bw" in cpu_flags() else ("native",)


def random_gguf(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, QuantWeight]:
    """A ``rows x cols`` tensor in GGUF format ``fmt`` as raw blocks: quantized from random floats where
    ``gguf`` has a quantizer, else random codes with sane float16 scales (K-quants)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[fmt]
    rng = np.random.default_rng(seed)
    if fmt in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        data = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        scale = lambda n: (rng.uniform(0.002, 0.02, n)).astype(np.float16).view(np.uint8).reshape(n, 2)
        if fmt == "Q4_K":  # d, dmin first
            data[..., 0:2] = scale(rows * cols // block).reshape(rows, -1, 2)
            data[..., 2:4] = scale(rows * cols // block).reshape(rows, -1, 2)
        else:  # Q6_K: d last
            data[..., size - 2:] = scale(rows * cols // block).reshape(rows, -1, 2)
        data = data.reshape(rows, -1)
    return data, from_gguf(data, fmt, rows, cols)


def _cols(fmt: str) -> int:
    return 512 if fmt.endswith("_K") else 96


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_layouts_equal_gguf_dequantization(fmt):
    from gguf import GGMLQuantizationType, quants

    data, qw = random_gguf(fmt, 7, _cols(fmt))
    ref = quants.dequantize(data, GGMLQuantizationType[fmt]).reshape(7, -1)
    assert torch.equal(qw.dequantize(), torch.from_numpy(ref))
    assert torch.equal(qw.dequantize(torch.tensor([5, 0])), torch.from_numpy(ref[[5, 0]]))


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[n, R]``: float32 rounding of a product (module docstring)."""
    return 1e-5 * (x.abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_bound_and_row_independence(arch):
    k = load_kernels(arch)
    torch.manual_seed(0)
    for fmt in GGUF_FORMATS:
        for R in (1, 5, 37):
            K = _cols(fmt) if fmt.endswith("_K") else (32 if R == 5 else 96)
            qw = random_gguf(fmt, R, K, seed=R)[1]
            w = qw.dequantize()
            x = torch.randn(max(ROWS), K) * torch.rand(1, K) * 3  # uneven magnitudes across blocks
            off = qw.offsets if qw.offsets is not None else torch.empty(0)
            def run(rows, qw=qw, off=off):
                return k.qlinear(rows, qw.codes, qw.scales, off, qw.block, qw.layout == "u4")

            full = run(x)
            err = (full - x @ w.T).abs()
            assert (err <= _bound(x, w)).all(), (arch, fmt, R, K, (err - _bound(x, w)).max())
            for n in ROWS:  # a row's result does not depend on the other rows of the call
                for start in (0, max(ROWS) - n):
                    assert torch.equal(run(x[start:start + n]), full[start:start + n]), (arch, fmt, R, n)


def test_kernels_exceed_the_bound_when_weights_are_wrong():
    """The bound is tight enough to catch a kernel that reads a weight wrong: flip one code."""
    k = load_kernels()
    qw = quantize(torch.randn(8, 64), "Q4_1")
    wrong = qw.codes.clone()
    wrong[3, 5] ^= 0x30  # one high nibble
    x = torch.randn(4, 64)
    y = k.qlinear(x, wrong, qw.scales, qw.offsets, 32, True)
    assert ((y - x @ qw.dequantize().T).abs() > _bound(x, qw.dequantize())).any()


def test_dequant_rows_is_the_embedding():
    k = load_kernels()
    for fmt in GGUF_FORMATS:
        qw = random_gguf(fmt, 11, _cols(fmt))[1]
        ids = torch.tensor([3, 0, 10, 3])
        off = qw.offsets if qw.offsets is not None else torch.empty(0)
        got = k.dequant_rows(ids, qw.codes, qw.scales, off, qw.block, qw.layout == "u4")
        assert torch.equal(got, qw.dequantize(ids)), fmt


def _quantized_tiny(kind: str, fmt: str):
    """A tiny model quantized to ``fmt``: ``int8``/``int4`` by :func:`quantize_model`, ``kquant`` with
    every layer matrix replaced by random Q4_K / Q6_K codes (Gemma-3's file mixes them)."""
    if kind == "llama":
        model = tiny_llama(layers=2)
    else:
        from transformers import Gemma3ForCausalLM

        base = tiny_gemma3()
        cfg = base.config
        if fmt == "kquant":  # K-quant blocks span 256 inputs
            cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 256, 64
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(cfg).eval()
        model.generation_config.eos_token_id = None
    if fmt != "kquant":
        quantize_model(model, fmt)
        return model
    quant = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        if ".layers." in name and p.dim() == 2:
            quant[name] = random_gguf("Q4_K" if i % 2 else "Q6_K", p.shape[0], p.shape[1], seed=i)[1]
            with torch.no_grad():
                p.copy_(quant[name].dequantize() * 2)  # codes' scale: keep activations in range
    quantize_model(model, "int8")  # embedding and head to Q8_0 ...
    model.speculum_quant.update(quant)  # ... the layers to the K-quants
    return model


def _prompts(n, seed):
    rng = random.Random(seed)
    return [([rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 8))] * rng.randint(1, 4))[:40]
            for _ in range(n)]


@pytest.mark.parametrize("kind,fmt", [("llama", "int4"), ("llama", "int8"), ("gemma3", "int4"),
                                      ("gemma3", "kquant")])
def test_quantized_tiny_models_are_lossless(kind, fmt):
    """Oracle chains and trees and prompt lookup reproduce plain greedy decoding of the quantized weights."""
    model = _quantized_tiny(kind, fmt)
    runner = NativeRunner(model)
    assert type(runner.decoder.layers[0].qkv).__name__ in ("QuantizedLinear", "StackedLinear")
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    for i, prompt in enumerate(_prompts(24, 7)):
        ref = ar.generate(prompt, 24).tokens
        for shape in ("chain", "tree"):
            drafter = OracleDrafter(prompt + ref, TINY_VOCAB, max_len=12, shape=shape, seed=i)
            assert Engine(runner, drafter, eos_token_ids=[]).generate(prompt, 24).tokens == ref, (i, shape)
        assert Engine(runner, NgramDrafter(), eos_token_ids=[]).generate(prompt, 24).tokens == ref, i


def test_quantized_model_differs_from_float():
    """``int4`` is another model: its logits move away from the float model's (the test would pass
    vacuously if quantization changed nothing)."""
    model = tiny_llama()
    float_logits = NativeRunner(model).decoder.logits(torch.randn(3, 64))
    qmodel = tiny_llama()
    quantize_model(qmodel, "int4")
    h = torch.randn(3, 64)
    a, b = NativeRunner(model).decoder.logits(h), NativeRunner(qmodel).decoder.logits(h)
    assert float_logits.shape == b.shape and not torch.allclose(a, b, atol=1e-4)
    assert torch.allclose(a, b, atol=0.5)  # ... but close to it
