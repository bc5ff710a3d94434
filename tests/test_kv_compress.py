"""KV policies that compress what they keep: ThinK (pruned key channels), GEAR (quantization + low-rank
+ sparse), ZipCache (mixed precision by saliency), ShadowKV (low-rank pre-RoPE keys, sparse reads),
and the residual window that KIVI, GEAR and ZipCache share.

- Constructed examples: each policy keeps and reads what its paper's rule says.
- Quantized stores: bytes below the full cache by the expected factor; GEAR's reconstruction error
  below KIVI's at the same bits on data with outliers.
- Step invariance: a chain step's rows read what one-token steps read, through a lossy window.
- Drafters: with a covering setting every drafter equals plain decoding; with a lossy one memory
  falls and every drafter equals ``ar`` under the same policy (tiny Llama and tiny Gemma-3).
"""

import random

import pytest
import torch
from conftest import TINY_VOCAB, tiny_gemma3, tiny_llama
from kv_lossless import ar_tokens, assert_drafters_equal_ar, lookup_prompt

from speculum.attention import AttentionLayout, Rotary, attention, attention_parts, rotate
from speculum.cache.gear import GearKVCache
from speculum.cache.mixed import MixedKVCache
from speculum.cache.quantized import QuantKVCache
from speculum.cache.shadow import ShadowKVCache
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import POLICIES, make_policy
from speculum.kv.shadowkv import outlier_chunks
from speculum.kv.think import channel_scores
from speculum.kv.zipcache import ZipCachePolicy
from speculum.runners import PolicyRunner, runner_for, under_policy
from speculum.tree import DraftTree

NEW = 24


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return tiny_llama(layers=6) if request.param == "llama" else tiny_gemma3()


def _layout(heads=2, kv_heads=1, d=64, layers=1, rotary=()) -> AttentionLayout:
    return AttentionLayout(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=d, scale=d ** -0.5,
                           rotary=rotary)


def _kv_bytes(model, spec, budget, prompt):
    engine = Engine(under_policy(runner_for(model, "native"), make_policy(spec, budget)), AutoregressiveDrafter(),
                    eos_token_ids=[])
    return engine.generate(prompt, NEW).kv_bytes


# -- constructed examples --------------------------------------------------------------------------

def test_think_keeps_the_channels_queries_and_keys_weigh_together():
    qw = torch.zeros(4, 2, 8)  # [w, H, d], one KV head for both query heads
    qw[:, :, 1], qw[:, :, 5] = 1.0, 2.0
    keys = torch.full((1, 10, 8), 0.1)
    keys[:, :, 1] += 1
    keys[:, :, 5] += 1
    keys[:, :, 7] += 5  # large keys that no query reads
    assert set(channel_scores(qw, keys).topk(2).indices[0].tolist()) == {1, 5}


def test_attention_over_pruned_channels_is_attention_with_those_channels_zeroed():
    torch.manual_seed(0)
    q, k1, v1, k2, v2 = torch.randn(3, 4, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    chan = torch.tensor([[0, 2, 5], [1, 3, 7]])
    pruned = k1.gather(-1, chan[:, None, :].expand(-1, 5, -1))
    out = attention_parts(q, [(pruned, v1, None, chan), (k2, v2, None, None)], 0.3)
    zeroed = torch.zeros_like(k1).scatter(-1, chan[:, None, :].expand(-1, 5, -1), pruned)
    ref = attention(q, torch.cat([zeroed, k2], 1), torch.cat([v1, v2], 1), None, 0.3, explicit=True)
    torch.testing.assert_close(out, ref)


def _outlier_data(t=256, d=64, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(2, 1, t, d)
    x[0, :, :, 5] += 8  # a key channel with a constant offset (KIVI's per-channel case)
    x.view(-1)[torch.randperm(x.numel())[:300]] *= 12  # scattered outliers
    return x


@pytest.mark.parametrize("bits", [2, 4])
def test_gear_error_below_kivi_at_the_same_bits_and_bytes(bits):
    x, lay = _outlier_data(), _layout()
    full = x.numel() * 2  # bfloat16
    err = {}
    for name, cache in [("kivi", QuantKVCache(lay, torch.bfloat16, "cpu", 256, bits, 32, 0)),
                        ("gear", GearKVCache(lay, torch.bfloat16, "cpu", 256, bits, 32, 0, 4, 0.02))]:
        cache.allocate(256)
        cache.store_quantized(0, x[0], x[1])
        cache.tq = 256
        back = cache.dequantized(0, 0)
        err[name] = max(float((b.float() - a).norm() / a.norm()) for a, b in zip(x, back))
        err[name + " bytes"] = cache.store_nbytes() / full
    assert err["gear"] < 0.5 * err["kivi"]
    assert err["gear"] < (0.06 if bits == 4 else 0.25)
    # 4 bits: codes 1/4 of bfloat16 + float16 minima and steps; GEAR adds rank-4 factors and 2% exact entries
    # (bits + 1) / 16 of bfloat16 for KIVI's groups; GEAR adds 2 x 4/64 for the factors and 2% x 5 for the
    # outliers (a 4-byte index, a 2-byte value and the 4-byte correction the read through the codes adds)
    assert err["kivi bytes"] < (bits + 1.2) / 16 and err["gear bytes"] < err["kivi bytes"] + 0.19


def test_gear_chunk_reads_back_as_its_roundtrip():
    x, lay = _outlier_data(t=64), _layout()
    cache = GearKVCache(lay, torch.float32, "cpu", 64, 4, 32, 0, 4, 0.02)
    cache.allocate(64)
    cache.store_block(x[0][None], x[1][None], None)  # two chunks of one group each
    cache.tq = 64
    keys, values = cache.dequantized(0, 32)
    rk, rv = cache.roundtrip(0, x[0, :, 32:], x[1, :, 32:], None)
    assert len(cache.chunks) == 2 and torch.equal(keys, rk) and torch.equal(values, rv)


def test_zipcache_normalized_saliency_finds_the_late_token_accumulation_misses():
    """Token 0 collects attention from every early query; token 5 takes nearly all of the attention of
    the three queries that can see it. Accumulated attention prefers token 0, normalized token 5."""
    n, d = 8, 4
    keys = torch.zeros(1, n, d)
    keys[0, 0, 0], keys[0, 5, 1] = 1.0, 1.0
    q = torch.zeros(n, 1, d)
    q[:, 0, 0], q[5:, 0, 1] = 6.0, 40.0
    lay = AttentionLayout(layers=1, heads=1, kv_heads=1, head_dim=d, scale=1.0)
    cache = MixedKVCache(lay, torch.float32, "cpu", 16, 4, 4, 4, 2, 0.4)
    normalized = ZipCachePolicy.probe_saliency(cache, q, torch.arange(n), keys, None)[0]
    accumulated = normalized * torch.arange(n, 0, -1)  # times the number of queries that see each token
    assert int(accumulated.argmax()) == 0 and int(normalized.argmax()) == 5


def test_zipcache_salient_tokens_get_the_high_precision():
    torch.manual_seed(1)
    lay = _layout()
    keys, values = torch.randn(1, 40, 64), torch.randn(1, 40, 64)
    saliency = torch.rand(1, 40)
    cache = MixedKVCache(lay, torch.bfloat16, "cpu", 64, 8, 8, 4, 2, 0.4)
    cache.store_chunk(0, keys, values, saliency)
    cache.tq = 40
    chunk = cache.chunks[0]
    salient = chunk.salient[0, 0]
    assert int(salient.sum()) == 24 and set(saliency[0].topk(24).indices.tolist()) == set(salient.nonzero().flatten().tolist())
    for back, orig in zip(cache.dequantized(0, 0), (keys, values)):
        err = (back.float() - orig).abs().mean(-1)[0]
        assert err[salient].mean() < 0.5 * err[~salient].mean()
    # 60% of tokens at 4 bits, 40% at 2 (keys and values), a float16 minimum and step per value row
    assert cache.store_nbytes() < 0.3 * 2 * keys.numel() * 2


def test_shadowkv_outliers_low_rank_and_selection():
    torch.manual_seed(2)
    keys = torch.randn(1, 4, 16).expand(4, 4, 16).clone().transpose(0, 1).reshape(1, 16, 16)  # 4 chunks of 4 equal keys
    keys[0, 9] = -keys[0, 8]  # chunk 2 disagrees with its own mean
    out, rest, landmarks = outlier_chunks(keys, 4, 1)
    assert out.tolist() == [[2]] and rest.tolist() == [[0, 1, 3]]
    torch.testing.assert_close(landmarks[0, 1], keys[0, 4])
    # full rank: rebuilt keys equal the stored ones, RoPE undone then redone at their positions
    rot = Rotary(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    lay = _layout(heads=2, kv_heads=1, d=16, rotary=(rot,))
    raw = torch.randn(1, 16, 16)
    cos, sin = rot.cos_sin(torch.arange(16), torch.float32)
    post = rotate(raw, cos[:, 0], sin[:, 0])
    cache = ShadowKVCache(lay, torch.float32, "cpu", 32, 4)
    _, rest, landmarks = outlier_chunks(post, 4, 1)
    cache.store_shadow(0, torch.stack([post, torch.randn(1, 16, 16)]), rest, landmarks, rank=16)
    tokens = torch.arange(16)[None]
    torch.testing.assert_close(cache.rebuild_keys(0, tokens), post, atol=1e-4, rtol=1e-4)
    # a query along one landmark selects that chunk (rows choose independently)
    q = torch.zeros(2, 2, 16)
    q[0, :] = 20 * landmarks[0, 0] / landmarks[0, 0].norm()
    q[1, :] = 20 * landmarks[0, 2] / landmarks[0, 2].norm()
    chosen = cache.chosen_chunks(0, q, 1)
    assert chosen[0, 0].nonzero().flatten().tolist() == [0] and chosen[0, 1].nonzero().flatten().tolist() == [2]


# -- step invariance -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["kv_quant:bits=2,group=4,residual=4", "kv_quant:bits=2,group=4,residual=2",
                                  "gear:bits=2,group=4,residual=2", "zipcache:group=4,residual=2"])
def test_chain_rows_read_what_one_token_steps_read(spec):
    """A chain of 10 drafts crosses several group boundaries (deeper than the window when
    ``residual=2``): each row's logits equal those of one-token steps at its position."""
    model = tiny_llama(layers=2)
    rng = random.Random(0)
    prompt, drafts = [rng.randrange(TINY_VOCAB) for _ in range(30)], [rng.randrange(TINY_VOCAB) for _ in range(10)]
    runner = PolicyRunner(runner_for(model, "native"), make_policy(spec))
    cache = runner.new_cache(128)
    runner.prefill(cache, prompt[:-1])
    chain = runner.forward(cache, prompt[-1], DraftTree.chain(drafts)).logits
    assert cache.views(cache._views[0])[0], "the chain should read some groups compressed"
    cache = runner.new_cache(128)
    runner.prefill(cache, prompt[:-1])
    rows = []
    for token in [prompt[-1]] + drafts:
        rows.append(runner.forward(cache, token, DraftTree()).logits[0])
        runner.commit(cache)
    torch.testing.assert_close(chain, torch.stack(rows), atol=1e-4, rtol=1e-4)


# -- drafters --------------------------------------------------------------------------------------

COVERING = ["think:prune=0,snapkv=1", "gear:residual=100000", "zipcache:residual=100000",
            "shadowkv:rank=64,outliers=1,local=8"]


@pytest.mark.parametrize("spec", COVERING)
def test_covering_setting_equals_plain_decoding(tiny, spec):
    """Nothing evicted, nothing quantized (the window covers the context), no channel pruned, or
    every chunk read at full rank: every drafter's output is plain decoding's."""
    prompt = lookup_prompt(60)
    assert_drafters_equal_ar(tiny, spec, "100000", prompt, NEW, plain=ar_tokens(tiny, prompt, NEW))


LOSSY = [("think:snapkv=1", "12"), ("gear:bits=2,group=4,residual=4", "1"), ("zipcache:group=4,residual=4", "1"),
         ("kv_quant:bits=2,group=4,residual=2", "1"), ("shadowkv:rank=4,outliers=1,local=8", "12")]


@pytest.mark.parametrize("spec,budget", LOSSY)
def test_lossy_setting_holds_less_and_drafters_equal_ar(tiny, spec, budget):
    """Decisions at prefill (ThinK, SnapKV's tokens), per-token-independent storage read as one-token
    steps read it (the window's views), or per-row selection (ShadowKV): speculation keeps ``ar``'s
    output under the policy, and the policy holds fewer bytes."""
    prompt = lookup_prompt(60)
    assert _kv_bytes(tiny, spec, budget, prompt) < _kv_bytes(tiny, "full", budget, prompt)
    assert_drafters_equal_ar(tiny, spec, budget, prompt, NEW)


def test_registry_and_bad_options():
    assert {"think", "gear", "zipcache", "shadowkv"} <= set(POLICIES)
    for bad in ("think:prune=1", "think:recent=x", "gear:sparsity=2", "gear:bits=3", "zipcache:hi_bits=3",
                "zipcache:ratio=2", "shadowkv:rank=0", "shadowkv:chunk=x"):
        with pytest.raises(SpeculumError):
            make_policy(bad)
    assert repr(make_policy("think:snapkv=1", "0.5")) == "think(prune=0.4, snapkv, budget=0.5)"


@pytest.mark.slow
def test_packaged_models_under_covering_settings(smollm2_f32, gemma3_f32):
    """Real weights, float32, a prompt past Gemma-3's 512-token window: with nothing pruned, quantized
    or left out (ShadowKV at full rank reads every chunk), each policy decodes as without one."""
    from speculum.prompts import encode_prompt

    for model, tok in (smollm2_f32, gemma3_f32):
        ids = encode_prompt(tok, "The old lighthouse keeper wrote in his log every night. " * 60)
        runner = runner_for(model, "native")
        base = Engine(runner, AutoregressiveDrafter()).generate(ids, 16).tokens
        for spec in ("think:prune=0", "gear:residual=100000", "zipcache:residual=100000", "shadowkv:rank=1024"):
            engine = Engine(under_policy(runner, make_policy(spec, "100000")), AutoregressiveDrafter())
            assert engine.generate(ids, 16).tokens == base, spec
