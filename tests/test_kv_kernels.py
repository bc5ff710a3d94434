"""The KV-cache kernels (speculum/cache/kv_kernels.cpp) against torch references, on every code path this
machine runs (AVX-512, AVX2, portable):

- ``quant_attend`` (KIVI's packed store read as stored) equals attention over the dequantized store and
  the residual window, computed in float32: 2 and 4 bits, 1 to 17 query rows, grouped-query heads, a
  tree mask, a sliding window whose start cuts a token group, soft-capping, float32 and bfloat16;
- ``slot_attend`` (chosen slots read in place) equals attention over the gathered copy, ``slot_scores``
  the logits over it;
- each row's result does not depend on the other rows of the call;
- GEAR's read (``gear_attend``: the codes and its corrections in one pass) equals attention over its
  decoded store; ZipCache's (``zip_attend``: each chunk's parts read from their codes) over its decoded
  store, in slot order;
- the caches use them: ``QuantKVCache.attend`` and ``PositionedKVCache.attend_slots`` give the torch
  path's results, and TidalDecode and Quest no longer hold gathered copies.
"""

import pytest
import torch

from speculum.attention import (
    AttentionLayout,
    Step,
    attention,
    attention_probs,
    attention_scores,
    fold_queries,
    grouped,
    visibility,
)
from speculum.cache import PositionedKVCache, QuantKVCache
from speculum.cache.kernels import load_kv_kernels, mask3
from speculum.extensions import cpu_flags

ARCHS = ("native", "haswell", "x86-64") if "avx512bw" in cpu_flags() else ("native",)


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():  # as the runners call the caches
        yield


def _layout(H=6, Hkv=2, d=32, layers=2, window=None, softcap=None):
    sliding = (False, True) if window else ()
    return AttentionLayout(layers, H, Hkv, d, d ** -0.5, softcap, window, sliding)


def _tree_mask(n: int) -> torch.Tensor:
    """A tree over ``n`` new tokens: each node's parent is a random earlier node."""
    g = torch.Generator().manual_seed(n)
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[int(torch.randint(0, i, (1,), generator=g))]
    return anc


def _quant_cache(layout, dtype, bits, t_quant, resid, seed=0) -> QuantKVCache:
    """A cache with ``t_quant`` quantized entries and ``resid`` in the residual window (both layers)."""
    torch.manual_seed(seed)
    s = layout
    cache = QuantKVCache(s, dtype, "cpu", t_quant + resid + 64, bits, group=32, residual=32)
    cache.allocate(t_quant + resid + 64)
    # keys with channel outliers, as real keys have (what per-channel quantization is for)
    keys = torch.randn(s.layers, s.kv_heads, t_quant + resid, s.head_dim) * (1 + 4 * torch.rand(s.head_dim))
    values = torch.randn(s.layers, s.kv_heads, t_quant + resid, s.head_dim)
    cache.store_quantized(slice(None), keys[:, :, :t_quant], values[:, :, :t_quant])
    cache.tq = t_quant
    cache.reserve(t_quant + resid + 64)
    cache.resid.zero_()  # (the slots after the window are a step's new entries; masked ones must be finite)
    cache.resid[:, 0, :, :resid] = keys[:, :, t_quant:].to(dtype)
    cache.resid[:, 1, :, :resid] = values[:, :, t_quant:].to(dtype)
    cache.length = t_quant + resid
    return cache


def _quant_reference(cache: QuantKVCache, layer, sliding, q, step) -> torch.Tensor:
    """Attention over the store dequantized in float32 and the residual window (new entries written)."""
    s, n = cache.layout, step.n
    window = s.window if sliding else None
    start = min(0 if window is None else max(0, int(step.positions.min()) - window + 1), cache.tq) // 32 * 32
    dk, dv = cache.decoded(layer, start)  # float32
    rk = cache.resid[layer, 0, :, : cache.r + n].float()
    rv = cache.resid[layer, 1, :, : cache.r + n].float()
    k, v = torch.cat([dk, rk], 1), torch.cat([dv, rv], 1)
    mask = grouped(visibility(cache.length, step.positions, step.new_mask, window, start)[1], s.group, torch.float32)
    return attention(q.float(), k, v, mask, s.scale, s.softcap, explicit=True)


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_attend_equals_dequantized_attention(arch, dtype):
    ops = load_kv_kernels(arch)
    for bits in (2, 4):
        # SmolLM2-like heads (3 query heads a KV head here), and Gemma-3-270M's (4 on 1, head dim 256)
        for shape, window, softcap in (((6, 2, 32), None, None), ((6, 2, 32), 100, 30.0), ((4, 1, 256), 100, None)):
            layout = _layout(*shape, window=window, softcap=softcap)
            cache = _quant_cache(layout, dtype, bits, t_quant=320, resid=40, seed=bits)
            for n in (1, 3, 17):
                torch.manual_seed(n)
                q = torch.randn(n, layout.heads, layout.head_dim).to(dtype)
                k = torch.randn(n, layout.kv_heads, layout.head_dim).to(dtype)
                v = torch.randn(n, layout.kv_heads, layout.head_dim).to(dtype)
                step = Step(torch.arange(cache.length, cache.length + n), _tree_mask(n) if n > 1 else None)
                for layer in range(layout.layers):
                    sliding = layout.is_sliding(layer)
                    want = _quant_reference_after_write(cache, layer, sliding, q, k, v, step)
                    got = _quant_kernel(ops, cache, layer, sliding, q, step)
                    assert got.dtype == dtype and got.shape == (n, layout.heads * layout.head_dim)
                    torch.testing.assert_close(got.float(), want, **_tol(dtype),
                                               msg=f"{arch} {dtype} bits {bits} n {n} layer {layer}")


def _quant_reference_after_write(cache, layer, sliding, q, k, v, step):
    from speculum.cache.store import put

    put(cache.resid[layer], cache.r, k, v)
    return _quant_reference(cache, layer, sliding, q, step)


def _quant_kernel(ops, cache: QuantKVCache, layer, sliding, q, step):
    """``quant_attend`` as :meth:`QuantKVCache.attend` calls it (entries already written), on ``ops``."""
    s, n = cache.layout, step.n
    window = s.window if sliding else None
    start = min(0 if window is None else max(0, int(step.positions.min()) - window + 1), cache.tq) // 32 * 32
    visible = visibility(cache.length, step.positions, step.new_mask, window, start)[1]
    return ops.quant_attend(q, cache.kcodes[layer], cache.klo[layer], cache.kstep[layer], cache.vcodes[layer],
                            cache.vlo[layer], cache.vstep[layer], cache.bits, start, cache.tq,
                            cache.resid[layer, 0, :, : cache.r + n], cache.resid[layer, 1, :, : cache.r + n],
                            mask3(visible), s.scale, s.softcap or 0.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_are_computed_alone(arch):
    """A row's result is the same bits whatever other rows share the call (a one-row call at the same
    position and visibility gives it too)."""
    ops = load_kv_kernels(arch)
    layout = _layout()
    cache = _quant_cache(layout, torch.float32, 4, t_quant=1280, resid=40)
    n = 9
    torch.manual_seed(1)
    q = torch.randn(n, layout.heads, layout.head_dim)
    cache.resid[0, :, :, cache.r:cache.r + n] = torch.randn(2, layout.kv_heads, n, layout.head_dim)  # the new entries
    step = Step(torch.arange(cache.length, cache.length + n), _tree_mask(n))
    many = _quant_kernel(ops, cache, 0, False, q, step)
    vis = visibility(cache.length, step.positions, step.new_mask, None)[0]  # [n, L]
    for i in (0, 4, 8):
        # row i alone: the columns it sees, as a one-row mask
        one = ops.quant_attend(q[i:i + 1], cache.kcodes[0], cache.klo[0], cache.kstep[0], cache.vcodes[0],
                               cache.vlo[0], cache.vstep[0], 4, 0, cache.tq, cache.resid[0, 0, :, : cache.r + n],
                               cache.resid[0, 1, :, : cache.r + n], mask3(vis[i:i + 1]), layout.scale, 0.0)
        assert torch.equal(one, many[i:i + 1]), (arch, i)


def _positioned(layout, dtype, length, seed=0) -> PositionedKVCache:
    torch.manual_seed(seed)
    cache = PositionedKVCache(layout, dtype, "cpu", length + 64)
    cache.reserve(length + 64)
    cache.kv[:, :, :, :length] = torch.randn(layout.layers, 2, layout.kv_heads, length, layout.head_dim).to(dtype)
    cache.pos[:, :, :length] = torch.arange(length)
    cache.length = length
    return cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_attend_equals_the_copying_read(arch, dtype):
    ops = load_kv_kernels(arch)
    layout = _layout(H=9, Hkv=3, d=64, layers=1)
    cache = _positioned(layout, dtype, 700)
    for n, m in ((1, 100), (5, 257), (12, 700)):
        torch.manual_seed(n)
        slots = torch.stack([torch.randperm(700)[:m].sort().values for _ in range(layout.kv_heads)])  # [H_kv, m]
        q = torch.randn(n, layout.heads, layout.head_dim).to(dtype)
        k = torch.randn(n, layout.kv_heads, layout.head_dim).to(dtype)
        v = torch.randn(n, layout.kv_heads, layout.head_dim).to(dtype)
        step = Step(torch.arange(700, 700 + n), _tree_mask(n) if n > 1 else None)
        cache.write(0, k, v)
        block = cache.gather_block([0], slots, n)[0].float()
        block[:, :, m:] = cache.kv[0, :, :, 700:700 + n].float()
        new = visibility(0, step.positions, step.new_mask, None)[0]  # [n, n] or None
        mask = grouped(visibility(m, step.positions, step.new_mask, None)[0], layout.group, torch.float32)
        want = attention(q.float(), block[0], block[1], mask, layout.scale, None, explicit=True)
        got = ops.slot_attend(q, cache.kv[0, 0], cache.kv[0, 1], slots, 0, 700, n, mask3(new), layout.scale, 0.0)
        torch.testing.assert_close(got.float(), want, **_tol(dtype), msg=f"{arch} {dtype} n {n} m {m}")
        # every committed slot from 30 on (None), with a mask per KV head over all columns
        vis = torch.rand(layout.kv_heads, n, 670 + n) < 0.7
        vis[:, :, 670:] = torch.eye(n, dtype=torch.bool)
        full = cache.kv[0, :, :, 30: 700 + n].float()
        want = attention(q.float(), full[0], full[1], grouped(vis, layout.group, torch.float32), layout.scale, None,
                         explicit=True)
        got = ops.slot_attend(q, cache.kv[0, 0], cache.kv[0, 1], None, 30, 700, n, mask3(vis), layout.scale, 0.0)
        torch.testing.assert_close(got.float(), want, **_tol(dtype), msg=f"{arch} {dtype} n {n} all slots")
        # the logits alone (what TidalDecode's selection softmaxes), chosen slots and a range
        want = attention_scores(fold_queries(q.float(), layout.kv_heads), block[0, :, :m], None, layout.scale)
        got = ops.slot_scores(q, cache.kv[0, 0], slots, 0, 700, mask3(None), layout.scale, 0.0)
        torch.testing.assert_close(got, want, **_tol(dtype))
        want = attention_scores(fold_queries(q.float(), layout.kv_heads), cache.kv[0, 0, :, 30:700].float(), None,
                                layout.scale)
        got = ops.slot_scores(q, cache.kv[0, 0], None, 30, 700, mask3(None), layout.scale, 0.0)
        torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_caches_read_through_the_kernels(monkeypatch, dtype):
    """``QuantKVCache.attend``, ``PositionedKVCache.attend_slots`` and ``attend_all`` give their torch
    paths' results (to the torch path's own rounding: in bfloat16 it rounds dequantized entries, scores
    and probabilities)."""
    from speculum.cache import quantized

    tol = _tol(dtype) if dtype == torch.float32 else {"atol": 6e-2, "rtol": 6e-2}
    layout = _layout(window=100)
    for bits in (2, 4):
        cache = _quant_cache(layout, dtype, bits, t_quant=320, resid=40)
        n = 4
        q = torch.randn(n, layout.heads, layout.head_dim).to(dtype)
        k = torch.randn(n, layout.kv_heads, layout.head_dim).to(dtype)
        v = torch.randn(n, layout.kv_heads, layout.head_dim).to(dtype)
        step = Step(torch.arange(cache.length, cache.length + n), None)
        for layer in range(2):
            got = cache.attend(layer, layout.is_sliding(layer), q, k, v, step)
            with monkeypatch.context() as m:
                m.setattr(quantized, "kernels_for", lambda *a: None)
                want = cache.attend(layer, layout.is_sliding(layer), q, k, v, step)
            torch.testing.assert_close(got.float(), want.float(), **tol)
    cache = _positioned(_layout(window=100), dtype, 300)
    slots = torch.arange(0, 300, 3).expand(2, -1)
    step = Step(torch.arange(300, 303), None)
    q = torch.randn(3, 6, 32).to(dtype)
    k, v = torch.randn(3, 2, 32).to(dtype), torch.randn(3, 2, 32).to(dtype)
    got = cache.attend_slots(0, q, k, v, slots, step)
    want = cache.attend_block(0, q, k, v, cache.gather_block([0], slots, 3)[0], step)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # TidalDecode's selection weights over the committed slots, all of them or a mask per row
    ptol = {"atol": 1e-3 if dtype == torch.bfloat16 else 1e-6, "rtol": 1e-2 if dtype == torch.bfloat16 else 1e-4}
    want = attention_probs(q, cache.kv[0, 0, :, :300], None, layout.scale)
    torch.testing.assert_close(cache.slot_probs(0, q, 300), want, **ptol)
    visible = torch.rand(3, 300) < 0.5
    want = attention_probs(q, cache.kv[0, 0, :, :300], grouped(visible, layout.group, torch.float32), layout.scale)
    torch.testing.assert_close(cache.slot_probs(0, q, 300, visible), want, **ptol)
    # dense reads (attend_all) in place too: a full layer, a sliding one, and one after an eviction, whose
    # window is a mask per KV head over the positions the slots hold
    for evicted in (0, 40):
        cache.evicted = evicted
        cache.pos[:, 1, :300] += torch.arange(300) // 7 if evicted else 0
        for layer, sliding in ((0, False), (1, True)):
            got = cache.attend_all(layer, sliding, q, k, v, step)
            start, end = cache.window_start(layer, sliding, step), cache.length + 3
            kv = cache.kv[layer, :, :, start:end]
            want = cache.attend(q, kv[0], kv[1], cache.mask(layer, sliding, step, start))
            torch.testing.assert_close(got.float(), want.float(), **tol)


def _generate(model, prompt, spec, budget, new=24):
    from speculum.drafters.ar import AutoregressiveDrafter
    from speculum.engine import Engine
    from speculum.kv import make_policy
    from speculum.runners import runner_for, under_policy

    engine = Engine(under_policy(runner_for(model, "native"), make_policy(spec, budget)), AutoregressiveDrafter(),
                    eos_token_ids=[])
    return engine.generate(prompt, new)


@pytest.mark.parametrize("spec,budget", [("kv_quant", "-"), ("kv_quant:bits=2", "-"), ("tidal:layers=2+4", "12"),
                                         ("quest:page=4", "12"), ("gear", "-"), ("zipcache", "-")])
def test_policies_decode_alike_with_and_without_the_kernels(monkeypatch, spec, budget):
    """A tiny Llama (float32) decodes the same tokens whether the policy's reads run on the kernels or
    on the torch path (dequantized layers, gathered copies); TidalDecode keeps slot indices, not copies."""
    from conftest import tiny_llama

    from speculum.cache import gear, mixed, positioned, quantized

    model = tiny_llama(layers=6)
    prompt = [int(x) for x in torch.randint(0, 96, (80,), generator=torch.Generator().manual_seed(5))]
    fast = _generate(model, prompt, spec, budget)
    monkeypatch.setattr(quantized, "kernels_for", lambda *a: None)
    for module in (positioned, gear, mixed):
        monkeypatch.setattr(module, "kernels_for", lambda *a: None)
    slow = _generate(model, prompt, spec, budget)
    assert fast.tokens == slow.tokens


def test_a_killed_builds_baton_does_not_hang_the_next_load():
    """torch's builder leaves a ``lock`` file in the build directory while it compiles; a build killed
    midway leaves it behind. Every build runs under speculum's own file lock, so the next load removes
    it rather than waiting for it forever."""
    from speculum.cache.kernels import SOURCES
    from speculum.extensions import build_extension, source_key, target_arch
    from speculum.models import cache_dir

    load_kv_kernels()  # built (or loaded) once
    where = cache_dir() / "kernels" / source_key(SOURCES, target_arch())
    (where / "lock").touch()
    assert build_extension("speculum_kvkernels", SOURCES).isa() == load_kv_kernels().isa()
    assert not (where / "lock").exists()


@pytest.mark.parametrize("bits", [2, 4])
def test_gear_read_through_the_codes_equals_decoded_attention(bits):
    """GEAR's read (``gear_attend``: the codes, the low-rank terms factored and the outliers' corrections in
    one pass) equals attention over the decoded store (its torch path): a prompt chunk
    and two one-group chunks, reads from a start inside the prompt chunk, a mask, soft-capping."""
    from speculum.cache.gear import GearKVCache
    from speculum.cache.kernels import kv_kernels
    from speculum.cache.window import WindowKVCache

    ops = kv_kernels()
    if ops is None:
        pytest.skip("the KV kernels are not built here")
    torch.manual_seed(bits)
    for softcap in (None, 30.0):
        layout = _layout(H=6, Hkv=2, d=64, layers=2, softcap=softcap)
        cache = GearKVCache(layout, torch.float32, "cpu", 192, bits, 32, 32, 4, 0.02)
        cache.allocate(192)
        assert cache.kernel_reads(ops)
        x = torch.randn(2, 2, 2, 128, 64)  # [layers, kind, H_kv, t, d]
        x[:, 0, :, :, 3] += 6  # a key channel offset
        x.view(-1)[torch.randperm(x.numel())[:200]] *= 10  # scattered outliers
        for layer in range(2):
            cache.store_quantized(layer, x[layer, 0, :, :64], x[layer, 1, :, :64])  # the prompt's chunk
        cache.tq = 64
        cache.store_block(x[:, 0, :, 64:], x[:, 1, :, 64:], None)  # two chunks of one group
        cache.tq = 128
        assert len(cache.chunks) == 3
        n, m = 3, 5
        q = torch.randn(n, 6, 64)
        keys, values = torch.randn(2, m, 64), torch.randn(2, m, 64)
        for start in (0, 32, 96, 128):
            vis = torch.rand(n, 128 - start + m) < 0.7
            vis[:, -1] = True
            for layer in range(2):
                for visible in (None, vis):
                    want = WindowKVCache.read(cache, layer, q, start, keys, values, visible)
                    got = cache.read(layer, q, start, keys, values, visible)
                    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4,
                                               msg=f"bits {bits} softcap {softcap} start {start} layer {layer}")
                    for i in range(n):  # each row as a one-row call gives it: rows are computed alone
                        one = cache.read(layer, q[i:i + 1], start, keys, values,
                                         None if visible is None else visible[i:i + 1])
                        assert torch.equal(one, got[i:i + 1])


def _mixed_cache(layout, dtype, ratio=0.4, chunks=(77, 32, 32), resid=9, seed=0):
    """A ZipCache store of ``chunks`` (the prompt's ragged one, then groups; both layers, random saliency)
    and ``resid`` entries in the window."""
    from speculum.cache.mixed import MixedKVCache

    torch.manual_seed(seed)
    s, t = layout, sum(chunks)
    cache = MixedKVCache(s, dtype, "cpu", t + resid + 64, 32, 32, 4, 2, ratio)
    keys = torch.randn(s.layers, s.kv_heads, t + resid, s.head_dim) * (1 + 4 * torch.rand(s.head_dim))
    values = torch.randn(s.layers, s.kv_heads, t + resid, s.head_dim)
    at = 0
    for size in chunks:
        for layer in range(s.layers):
            cache.store_chunk(layer, keys[layer, :, at:at + size], values[layer, :, at:at + size],
                              torch.rand(s.kv_heads, size), at=at)
        at += size
    cache.tq = t
    cache.reserve(t + resid + 64)
    cache.resid[:, 0, :, :resid] = keys[:, :, t:].to(dtype)
    cache.resid[:, 1, :, :resid] = values[:, :, t:].to(dtype)
    cache.length = t + resid
    return cache


def _mixed_reference(cache, layer, q, start, keys, values, visible):
    """Attention in float32 over the store decoded (slots ``start .. tq-1``) and the float rows."""
    k, v = keys.float(), values.float()
    if start < cache.tq:
        first = next(c.start for c in cache.chunks if c.end > start)
        parts = [cache.decode(c, layer) for c in cache.chunks if c.end > start]
        k = torch.cat([torch.cat([p[0] for p in parts], dim=1)[:, start - first:], k], dim=1)
        v = torch.cat([torch.cat([p[1] for p in parts], dim=1)[:, start - first:], v], dim=1)
    s = cache.layout
    mask = None if visible is None else grouped(visible, s.group, torch.float32)
    return attention(q.float(), k, v, mask, s.scale, s.softcap)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zip_attend_equals_decoded_attention(arch, dtype):
    """``zip_attend`` (ZipCache's parts read from their codes, in part order) equals attention over the store
    decoded into slot order: head dims 64 and 16 (whole and repeated code chunks), a ragged prompt chunk
    and two groups, ratios 0.4, 0 and 1 (a chunk without one of its parts), starts before, inside and past
    the chunks, a tree mask that hides store slots, soft-capping, 1 and 5 rows; each row as computed alone.
    A broken read (a part left out, the salient flags read inverted) is told apart."""
    ops = load_kv_kernels(None if arch == "native" else arch)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else _tol(dtype)
    for d, ratio, softcap in ((64, 0.4, None), (16, 0.4, 30.0), (64, 0.0, None), (16, 1.0, None)):
        layout = _layout(H=6, Hkv=2, d=d, softcap=softcap)
        cache = _mixed_cache(layout, dtype, ratio)
        assert cache.kernel_reads(ops)
        m = cache.r
        for n in (1, 5):
            q = torch.randn(n, 6, d).to(dtype)
            keys = torch.cat([cache.resid[0, 0, :, :m], torch.randn(2, n, d).to(dtype)], dim=1)
            values = torch.cat([cache.resid[0, 1, :, :m], torch.randn(2, n, d).to(dtype)], dim=1)
            for start in (0, 32, 96, 141):
                L = cache.tq - start + m + n
                hidden = torch.rand(n, L) < 0.3
                hidden[:, -1] = False
                for visible in (None, ~hidden):
                    want = _mixed_reference(cache, 0, q, start, keys, values, visible)
                    tensors, meta = cache.part_operands(start)

                    def call(t, mt, vis=visible, st=start, q=q, keys=keys, values=values, cache=cache):
                        s = cache.layout
                        return ops.zip_attend(q, t, mt, 0, st, cache.tq, keys, values, mask3(vis), s.scale,
                                              s.softcap or 0.0)
                    got = call(tensors, meta).float()
                    msg = f"d {d} ratio {ratio} n {n} start {start} mask {visible is not None}"
                    torch.testing.assert_close(got, want, **tol, msg=msg)
                    for i in range(n):
                        one = ops.zip_attend(q[i:i + 1], tensors, meta, 0, start, cache.tq, keys, values,
                                             mask3(None if visible is None else visible[i:i + 1]), layout.scale,
                                             softcap or 0.0)
                        assert torch.equal(one.float(), got[i:i + 1]), msg
                    if start == 32 and ratio == 0.4:  # the comparison catches a broken read: a part left
                        # out, the key minima and steps swapped, the mask not applied to the store's slots
                        swapped = [tensors[j ^ 3] if j % 8 in (1, 2) else x for j, x in enumerate(tensors)]
                        broken = [call(tensors[8:], meta[3:]), call(swapped, meta)]
                        if visible is not None:
                            broken.append(ops.zip_attend(q, tensors, meta, 0, start, cache.tq, keys, values,
                                                         mask3(visible[:, cache.tq - start:]), layout.scale,
                                                         softcap or 0.0))
                        for bad in broken:
                            assert not torch.allclose(bad.float(), want, **tol), msg
        # the cache's read (the step's path) is the kernel's
        q = torch.randn(2, 6, d).to(dtype)
        got = cache.read(1, q, 32, cache.resid[1, 0, :, :m], cache.resid[1, 1, :, :m], None)
        want = _mixed_reference(cache, 1, q, 32, cache.resid[1, 0, :, :m], cache.resid[1, 1, :, :m], None)
        torch.testing.assert_close(got.float(), want, **tol)
    tensors, meta = cache.part_operands(0)
    with pytest.raises(RuntimeError, match="8 tensors"):
        ops.zip_attend(q, tensors[:-1], meta, 0, 0, cache.tq, keys, values, mask3(None), layout.scale, 0.0)
