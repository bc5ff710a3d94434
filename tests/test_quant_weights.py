"""Quantized weights: the GGUF formats' layouts, the kernels' accuracy and row independence, and
lossless speculative decoding on quantized tiny models (the packaged models: test_real_models.py).

The kernels round each activation row to 8 bits per block of 32 (as llama.cpp does): a product equals
the rounded activations times the dequantized weights up to float rounding, which the tests bound by
``1e-5 * sum |x| |w|`` per output; the AVX-512, AVX2 and portable code give the same bits.
The compiled layer ops (norms, rotary, attention) compute every row alone, which the tests check on
whole forwards: a token's logits are the same bits in one-token steps, chains and tree branches.
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


def _product_cases(product, seed: int):
    """For every format and a few weight shapes: ``(case, x [32, K], w [R, K] dequantized, run)``, ``run``
    the kernel ``product`` on rows of ``x``."""
    torch.manual_seed(seed)
    for fmt in GGUF_FORMATS:
        for R in (1, 5, 37):
            K = _cols(fmt) if fmt.endswith("_K") else (32 if R == 5 else 96)
            qw = random_gguf(fmt, R, K, seed=R)[1]
            x = torch.randn(max(ROWS), K) * torch.rand(1, K) * 3  # uneven magnitudes across blocks
            def run(rows, qw=qw):
                return product(rows, *qw.kernel_args())

            yield (fmt, R, K), x, qw.dequantize(), run


def _assert_rows_independent(run, x: torch.Tensor, full: torch.Tensor, case) -> None:
    """A row's result does not depend on the other rows of the call."""
    for n in ROWS:
        for start in (0, max(ROWS) - n):
            assert torch.equal(run(x[start:start + n]), full[start:start + n]), (case, n)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """``x [n, K]`` rounded as the kernels round activations: 8 bits per block of 32, ``d = max|x| / 127``."""
    xb = x.double().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).round().clamp(-127, 127)
    return (q * d).view_as(x)


def _act8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[n, R]``: float rounding around the product of the rounded activations."""
    return _bound(_rounded(x).float(), w)


def test_kernels_are_rounded_activations_times_weights_on_every_isa():
    """Each format's product equals the rounded activations (:func:`_rounded`) times the dequantized
    weights to float rounding (so within ``d/2 * sum|w|`` per block of the float product), does round (it
    is not the float product), computes each row alone, and gives the same bits on every code path this
    machine runs (AVX-512, AVX2, portable)."""
    results = {}
    for arch in ARCHS:
        for case, x, w, run in _product_cases(load_kernels(arch).qlinear, 1):
            full = run(x)
            err = (full.double() - _rounded(x) @ w.double().T).abs()
            assert (err <= _act8_bound(x, w)).all(), (arch, case, (err - _act8_bound(x, w)).max())
            assert ((full - x @ w.T).abs() > _bound(x, w)).any(), (arch, case)
            _assert_rows_independent(run, x, full, (arch, case))
            assert torch.equal(results.setdefault(case, full), full), (arch, case)


def test_kernels_exceed_the_bound_when_weights_are_wrong():
    """The bound is tight enough to catch a kernel that reads one weight wrong: move one code to the far
    end of its range, where the activations are large."""
    k = load_kernels()
    torch.manual_seed(0)
    qw = quantize(torch.randn(8, 64), "Q4_1")
    q = qw.code_matrix().clone()
    q[1, 49] = 15 if q[1, 49] < 8 else 0
    wrong = QuantWeight.pack("u4", q, qw.scale_matrix(), qw.offset_matrix(), 32, "Q4_1")
    x = torch.randn(4, 64)
    x[:, 49] = 3.0
    w = qw.dequantize()
    want = (_rounded(x) @ w.double().T).float()
    assert ((k.qlinear(x, *qw.kernel_args()) - want).abs() <= _act8_bound(x, w)).all()
    assert ((k.qlinear(x, *wrong.kernel_args()) - want).abs() > _act8_bound(x, w)).any()


def test_dequant_rows_is_the_embedding():
    k = load_kernels()
    for fmt in GGUF_FORMATS:
        qw = random_gguf(fmt, 11, _cols(fmt))[1]
        ids = torch.tensor([3, 0, 10, 3])
        got = k.dequant_rows(ids, *qw.kernel_args())
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


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_ops_match_torch(arch):
    """The compiled glue between the products (norms, rotary, attention over the cache) computes what
    the decoder's torch path computes, to float32 rounding; per code path."""
    from speculum.attention import attention, grouped, rotate
    from speculum.runners.decoder import RMSNorm

    k = load_kernels(arch)
    torch.manual_seed(0)
    n, D, H, Hkv, d, C = 5, 96, 6, 2, 16, 40
    h, a = torch.randn(n, D), torch.randn(n, D) * 3
    w, w2 = torch.rand(D) + 0.5, torch.rand(D) + 0.5
    for gemma in (False, True):
        norm, norm2 = RMSNorm(w, 1e-6, gemma), RMSNorm(w2, 1e-5, gemma)
        assert torch.allclose(k.rms_norm(h, norm.scale32, 1e-6), norm(h), atol=1e-5)
        h2, x = k.add_rms_norm(h, a, norm.scale32, 1e-6, norm2.scale32, 1e-5)
        assert torch.allclose(h2, h + norm(a), atol=1e-5) and torch.allclose(x, norm2(h + norm(a)), atol=1e-5)
        h2, x = k.add_rms_norm(h, a, torch.empty(0), 0.0, torch.empty(0), 0.0)
        assert torch.equal(h2, h + a) and x.numel() == 0
    qkv = torch.randn(n, (H + 2 * Hkv) * d)
    ang = torch.rand(n, d // 2) * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    qs, ks = RMSNorm(torch.rand(d), 1e-6, True), RMSNorm(torch.rand(d), 1e-6, True)
    q, kk, v = k.rope_qkv(qkv, cos, sin, H, Hkv, qs.scale32, ks.scale32, 1e-6)
    rq, rk, rv = qkv.view(n, H + 2 * Hkv, d).split([H, Hkv, Hkv], 1)
    assert torch.allclose(q, rotate(qs(rq), cos[:, None], sin[:, None]), atol=1e-5)
    assert torch.allclose(kk, rotate(ks(rk), cos[:, None], sin[:, None]), atol=1e-5)
    assert torch.equal(v, rv)
    kv = torch.randn(1, 2, Hkv, C, d)
    write, keys = 20, 30  # slots 25..29 stay unseen by the mask; 20..24 take the new rows
    visible = torch.ones(n, keys, dtype=torch.bool)
    visible[:, write:] = False
    visible[:, write:write + n] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                               [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)  # a tree
    for softcap in (0.0, 5.0):
        for mask in (grouped(visible, H // Hkv, torch.float32), None):
            cache = kv.clone()
            got = k.attend_cache(q, kk, v, cache, 0, write, keys, torch.empty(0) if mask is None else mask, 0.25,
                                 softcap)
            assert torch.equal(cache[0, 0, :, write:write + n], kk.transpose(0, 1))
            want = attention(q, cache[0, 0, :, :keys], cache[0, 1, :, :keys], mask, 0.25, softcap or None)
            assert torch.allclose(got, want, atol=1e-5), (softcap, mask is None, (got - want).abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_of_rows_over_a_long_prefix_is_each_rows_alone(arch):
    """Several rows over a shared prefix longer than a block (attention then reads each block once for all
    of a KV head's queries) give each row the same bits as a one-row call over the same slots, under a
    tree mask, without a mask, with and without soft-capping; head sizes 64 and 256."""
    k = load_kernels(arch)
    g = torch.Generator().manual_seed(3)
    n, write = 5, 300
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
                        dtype=torch.bool)
    for Hkv, group, d in ((2, 3, 64), (1, 4, 256)):
        H, keys = Hkv * group, write + n
        q, kk, v = torch.randn(n, H, d, generator=g), torch.randn(n, Hkv, d, generator=g), torch.randn(n, Hkv, d, generator=g)
        kv = torch.randn(1, 2, Hkv, keys + 4, d, generator=g)
        visible = torch.ones(n, keys, dtype=torch.bool)
        visible[:, write:] = tree
        for softcap in (0.0, 5.0):
            for mask in (torch.zeros(n, keys).masked_fill(~visible, float("-inf")), None):
                cache = kv.clone()
                none = torch.empty(0)
                rows = k.attend_cache(q, kk, v, cache, 0, write, keys, none if mask is None else mask, 0.125, softcap)
                for i in range(n):  # the cache now holds every row's entries: row i alone rewrites its own
                    alone = k.attend_cache(q[i:i + 1], kk[i:i + 1], v[i:i + 1], cache, 0, write + i, keys,
                                           none if mask is None else mask[i:i + 1], 0.125, softcap)
                    assert torch.equal(alone[0], rows[i]), (Hkv, d, softcap, mask is None, i)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_quantized_forward_is_row_invariant(kind):
    """On quantized weights every row of a step is computed alone: a token's logits are the same bits
    whether one-token steps, a chain or a tree's branch computed them (what keeps speculative output
    equal to plain decoding's whatever the rounding)."""
    from speculum.tree import DraftTree, TreeBuilder

    runner = NativeRunner(_quantized_tiny(kind, "int4"))
    assert runner.decoder.ops is not None
    prompt, root, toks = list(range(3, 23)), 7, [11, 5, 40, 9, 33]
    cache = runner.new_cache(128)
    runner.prefill(cache, prompt)
    steps = []
    for t in [root] + toks:
        steps.append(runner.forward(cache, t, DraftTree.chain([])).logits[-1])
        cache.commit()
    assert not torch.equal(steps[0], steps[1])
    cache = runner.new_cache(128)
    runner.prefill(cache, prompt)
    chain = runner.forward(cache, root, DraftTree.chain(toks)).logits
    assert all(torch.equal(chain[i], steps[i]) for i in range(len(steps)))
    b = TreeBuilder()
    b.add_path([8, 12, 3], [3.0, 2.0, 1.0])
    b.add_path(toks, [0.5] * len(toks))
    b.add(0, 21, 0.1)
    tree = b.build()
    cache = runner.new_cache(128)
    runner.prefill(cache, prompt)
    logits = runner.forward(cache, root, tree).logits
    rows = [0] + [1 + tree.tokens.index(t) for t in toks]
    assert all(torch.equal(logits[r], steps[i]) for i, r in enumerate(rows))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_compiled_layers_equal_the_layer_ops_path(kind, monkeypatch):
    """A decode or verification step through the compiled layers (``QuantLayer``: one call per layer)
    gives the same bits as the layer ops called one by one from Python."""
    from speculum.tree import DraftTree

    runner = NativeRunner(_quantized_tiny(kind, "int4"))
    prompt, root, toks = list(range(3, 23)), 7, [11, 5, 40, 9]

    def step():
        cache = runner.new_cache(128)
        runner.prefill(cache, prompt)
        return runner.forward(cache, root, DraftTree.chain(toks)).logits

    compiled = step()
    assert runner.decoder._compiled and all(c is not None for _, c in runner.decoder._compiled.values())
    monkeypatch.setattr(type(runner.decoder), "_compiled_layer", lambda self, i, layer: None)
    assert torch.equal(step(), compiled)


def test_kv_draft_drafts_on_quantized_weights_as_they_are():
    """On a model whose layers already run quantized kernels, ``kv_draft`` drafts on them (no torch
    int4 copy); on float weights its default is the int4 copy."""
    from speculum.drafters.kv_draft import KVDraftDrafter

    quantized, plain = KVDraftDrafter(_quantized_tiny("llama", "int8")), KVDraftDrafter(tiny_llama(layers=2))
    assert quantized.model.weights[0] is quantized.decoder.layers[0]
    assert plain.model.weights[0] is not plain.decoder.layers[0]


def _head_products(drafter, kind: str) -> list:
    """The drafting-time products of a learned drafter's head (after ``freeze``)."""
    head = drafter.adapter if kind == "kangaroo" else drafter.head
    if kind == "medusa":
        return [head._first] + [lin for rest in head._rest for lin in rest]
    if kind == "hydra":
        return [lin for proj, blocks in head._fast for lin in (proj, *blocks)]
    return list(head._fast.values())


@pytest.mark.parametrize("kind", ["eagle", "medusa", "hydra", "kangaroo"])
def test_heads_draft_on_q8_copies_for_a_quantized_target(tmp_path, kind):
    """A head drafting for a model on quantized weights runs its own products on Q8_0 copies (the
    kernels'), and the output is still plain greedy decoding's; for a float model they stay float."""
    from conftest import random_head

    from speculum.methods import build_method
    from speculum.weights import QuantizedLinear

    model = _quantized_tiny("llama", "int8")
    path = random_head(model, tmp_path / f"{kind}.safetensors", kind=kind)
    method = build_method(kind, model, None, runner=NativeRunner(model), draft_head=str(path), sized=False)
    products = _head_products(method.engine.drafter, kind)
    assert products and all(isinstance(p, QuantizedLinear) for p in products)
    runner = NativeRunner(model)
    want = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[]).generate([1, 5, 9, 13, 2], 24).tokens
    assert method.engine.generate([1, 5, 9, 13, 2], 24).tokens == want
    float_model = tiny_llama(layers=2)
    float_path = random_head(float_model, tmp_path / f"float-{kind}.safetensors", kind=kind)
    float_method = build_method(kind, float_model, None, draft_head=str(float_path), sized=False)
    assert not any(isinstance(p, QuantizedLinear) for p in _head_products(float_method.engine.drafter, kind))
