"""KV policies (speculum.kv): exact where they keep everything, really smaller where they do not.

- Every policy whose budget covers the context is token-identical to decoding without a policy
  (float32), with plain decoding and with tree speculation, on tiny Llama (6 layers, so that
  TidalDecode and Quest have sparse layers) and tiny Gemma-3 (sliding-window layers).
- The layer-by-layer prefill gives bit-identical logits to the native runner's prefill.
- With a small budget, eviction keeps exactly the budget (plus slack while decoding) and the
  bytes shrink; TidalDecode's top-k equal to the context is full attention; KIVI packing is
  exact and its quantization error bounded; 4-bit KV is under 35% of the bfloat16 cache.
- The packaged SmolLM2 and Gemma-3 (past its window) decode identically through every policy
  with a covering budget, and the RULER-style suite scores and protocols behave.
"""

import random

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_gemma3, tiny_llama
from kv_lossless import assert_drafters_equal_ar, lookup_prompt

from speculum.attention import AttentionLayout, Step
from speculum.cache import PositionedKVCache
from speculum.cache.quantized import pack, quantize, unpack
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import POLICIES, Budget, make_policy
from speculum.kv.tidal import default_selection_layers
from speculum.runners import runner_for, under_policy
from speculum.runners.layerwise import prefill_layerwise

SPECS = ["streaming", "h2o", "snapkv", "tidal", "quest", "kv_quant"]
# policies whose output under speculation is plain decoding's under the same lossy budget (all of them)
STEP_INVARIANT = SPECS
# policies whose own test file runs these checks (covering budget, lossy budget, every drafter)
TESTED_ELSEWHERE = {"pyramidkv": "test_kv_budgets", "cake": "test_kv_budgets", "adakv": "test_kv_budgets",
                    "keyformer": "test_kv_evict", "d2o": "test_kv_evict", "chelsea": "test_kv_evict",
                    "double_sparsity": "test_kv_sparse", "tokenselect": "test_kv_sparse", "squeezed": "test_kv_sparse",
                    "recycled": "test_kv_sparse", "hip": "test_kv_sparse",
                    "think": "test_kv_compress", "gear": "test_kv_compress", "zipcache": "test_kv_compress",
                    "shadowkv": "test_kv_compress", "duo": "test_kv_duo"}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return tiny_llama(layers=6) if request.param == "llama" else tiny_gemma3()


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def _run(model, prompt, policy=None, drafter=None, new=40, **kw):
    engine = Engine(under_policy(runner_for(model, "native"), policy), drafter or AutoregressiveDrafter())
    return engine.generate(prompt, new, **kw)


@pytest.mark.parametrize("spec", SPECS)
def test_covering_budget_is_exact(tiny, spec):
    prompt = _prompt(50)
    base = _run(tiny, prompt)
    # budget beyond any context: nothing evicted, everything read (kv_quant: nothing leaves the
    # full-precision window)
    policy = make_policy(spec + (":residual=100000" if spec == "kv_quant" else ""), "100000")
    assert _run(tiny, prompt, policy).tokens == base.tokens
    tree = OracleDrafter(base.tokens, TINY_VOCAB, shape="tree", seed=3)
    assert _run(tiny, prompt, policy, tree).tokens == base.tokens
    # the query-agnostic protocol (context first, question appended) changes nothing either
    assert _run(tiny, prompt, policy, query_start=30).tokens == base.tokens


@pytest.mark.parametrize("spec", SPECS)
def test_small_budget_under_speculation(tiny, spec):
    """A lossy budget with tree speculation: runs to the end and holds less; where the policy's
    state does not depend on how tokens are grouped into steps (snapkv selects once, at prefill),
    tree speculation through the policy equals plain decoding through it."""
    prompt = _prompt(60, seed=5)
    base = _run(tiny, prompt)
    policy = make_policy(spec, "12")
    plain = _run(tiny, prompt, policy)
    tree = _run(tiny, prompt, policy, OracleDrafter(base.tokens, TINY_VOCAB, shape="tree", seed=4))
    assert plain.new_tokens == tree.new_tokens == 40
    if spec in ("streaming", "h2o", "snapkv", "kv_quant"):
        assert tree.kv_bytes < base.kv_bytes and plain.kv_bytes < base.kv_bytes
    if spec in STEP_INVARIANT:  # the tree is trimmed at the policy's decision points: plain decoding's output
        assert tree.tokens == plain.tokens


@pytest.mark.parametrize("spec", STEP_INVARIANT)
def test_every_drafter_equals_ar_under_a_lossy_policy(tiny, spec):
    """Eviction while decoding: each step's tree stops at the policy's next eviction (``draft_depth``);
    KIVI's rows read the groups a one-token step at their position would already have quantized
    (:class:`~speculum.cache.window.WindowKVCache`); TidalDecode's and Quest's rows each select from
    what a one-token step at their position would see (:mod:`speculum.kv.rows`): every drafter
    reproduces ``ar`` under the same lossy policy."""
    assert_drafters_equal_ar(tiny, spec, "12", lookup_prompt(60))


def test_layerwise_prefill_bit_identical(tiny):
    """Layer by layer or chunk by chunk through all layers: the same keys, values and logits."""
    runner = runner_for(tiny, "native")
    prompt = _prompt(70)
    cache = runner.new_cache(128)
    for a in range(0, len(prompt), 16):  # the native runner's chunked prefill, 16-token chunks
        chunk = prompt[a:a + 16]
        ref = runner._run(cache, chunk, Step(torch.arange(a, a + len(chunk)), None), True, ()).logits
        cache.commit()
    stored = {}
    logits = prefill_layerwise(runner.decoder, prompt, 16, None, 0, lambda i, s, kv, sc: stored.update({i: kv}))
    assert torch.equal(logits, ref)
    for i, kv in stored.items():
        assert torch.equal(kv, cache.kv[i, :, :, :70])


def test_layerwise_prefill_skips_keys_a_window_behind_as_the_native_runner(monkeypatch):
    """Gemma-3 (window 8) with the long-context read forced on (``WINDOW_SKIP_MIN`` 1): the sliding
    layers of both prefills read from a window behind each chunk, and still agree bit for bit; the
    logits stay those of the whole-span read to rounding."""
    import speculum.attention as attention_mod
    from speculum.runners import NativeDecoder

    model = tiny_gemma3(seed=4, window=8)
    prompt = _prompt(70, seed=2)
    read = []  # keys each layerwise chunk attends over
    real = NativeDecoder.attend
    monkeypatch.setattr(NativeDecoder, "attend", lambda self, q, k, v, mask, *a: read.append(k.shape[1]) or real(self, q, k, v, mask, *a))

    def both():
        runner = runner_for(model, "native")
        cache = runner.new_cache(128)
        for a in range(0, len(prompt), 16):
            chunk = prompt[a:a + 16]
            ref = runner._run(cache, chunk, Step(torch.arange(a, a + len(chunk)), None), True, ()).logits
            cache.commit()
        logits = prefill_layerwise(runner.decoder, prompt, 16, None, 0, lambda i, s, kv, sc: None)
        assert torch.equal(logits, ref)
        return logits

    whole = both()
    whole_read, read[:] = sum(read), []
    monkeypatch.setattr(attention_mod, "WINDOW_SKIP_MIN", 1)
    assert attention_mod.window_skip(48, 8) == 41
    torch.testing.assert_close(both(), whole, rtol=0, atol=1e-5)
    assert sum(read) < whole_read  # the sliding layers' later chunks read fewer keys


@pytest.mark.parametrize("spec", ["streaming", "h2o", "snapkv"])
def test_eviction_keeps_the_budget(spec):
    model = tiny_llama(layers=4)
    prompt = _prompt(80, seed=1)
    base = _run(model, prompt, new=60)
    policy = make_policy(spec, "20")
    engine = Engine(under_policy(runner_for(model, "native"), policy), AutoregressiveDrafter())
    cache = engine.runner.new_cache(200)
    engine.runner.prefill(cache, prompt[:-1])
    assert cache.length == 20 and cache.evicted == len(prompt) - 1 - 20
    per_entry = 4 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
    assert cache.nbytes() == 20 * per_entry
    assert base.kv_bytes == (79 + 60) * per_entry
    r = _run(model, prompt, policy, new=60)
    assert r.new_tokens == 60
    if spec == "snapkv":  # selects at prefill only; generated tokens are appended
        assert r.kv_bytes == (20 + 60) * per_entry
    else:  # evicts back to the budget once the cache runs `slack` past it
        assert r.kv_bytes == (20 + policy.slack(20) + 1) * per_entry


@torch.inference_mode()
def test_evicted_sliding_layer_reads_from_its_window():
    """After an eviction a sliding layer's slots no longer equal positions; it still starts reading at
    the first slot any head holds inside the window, masking what a head holds before it."""
    torch.manual_seed(3)
    layout = AttentionLayout(layers=1, heads=4, kv_heads=2, head_dim=8, scale=8 ** -0.5, window=3, sliding=(True,))
    cache = PositionedKVCache(layout, torch.float32, "cpu", 16)
    cache.reserve(16)
    prompt = torch.randn(2, 2, 8, 8)
    kept = [[0, 2, 5, 6, 7], [1, 3, 4, 5, 7]]
    cache.store_layer(0, prompt, torch.tensor(kept))
    cache.length, cache.evicted = 5, 3
    step = Step(torch.tensor([8, 9]), torch.ones(2, 2, dtype=torch.bool).tril())
    cache.begin(step.positions)
    assert cache.window_start(0, True, step) == 3  # positions 6.. : slot 3 in head 0, slot 4 in head 1
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    out = cache.attend_all(0, True, q, k, v, step).view(2, 4, 8)
    for j in range(4):
        h = j // 2
        held = torch.tensor([*kept[h], 8, 9])
        seen = (held[None, :] > step.positions[:, None] - 3) & (held[None, :] <= step.positions[:, None])
        keys, values = torch.cat([prompt[0, h, kept[h]], k[:, h]]), torch.cat([prompt[1, h, kept[h]], v[:, h]])
        want = ((q[:, j] @ keys.T) * layout.scale).masked_fill(~seen, float("-inf")).softmax(-1) @ values
        torch.testing.assert_close(out[:, j], want)


def test_snapkv_keeps_what_the_window_attends():
    """The observation window's votes decide: a token the window attends to strongly is kept."""
    policy = make_policy("snapkv:window=4,kernel=1", "8")
    kv = torch.zeros(2, 2, 40, 4)
    scores = torch.zeros(2, 40)
    scores[0, 7] = scores[1, 20] = 5.0
    idx = policy.select_prefill(kv, scores, 8)
    assert idx.shape == (2, 8)
    assert 7 in idx[0].tolist() and 20 in idx[1].tolist()
    assert idx[:, -4:].tolist() == [[36, 37, 38, 39]] * 2  # the window itself
    assert torch.all(idx[:, 1:] > idx[:, :-1])


def test_tidal_topk_at_context_is_full_attention_and_smaller_k_is_sparse():
    model = tiny_llama(layers=6)
    prompt = _prompt(60, seed=2)
    base = _run(model, prompt)
    assert _run(model, prompt, make_policy("tidal", str(len(prompt) + 40))).tokens == base.tokens
    sparse = _run(model, prompt, make_policy("tidal:layers=2+4", "8"))
    assert sparse.new_tokens == 40  # runs, reads 8 cached tokens in layers 3 and 5; output may differ
    assert default_selection_layers([False] * 32) == [6, 15]
    assert default_selection_layers([False] * 30) == [6, 14]
    gemma = [True] * 5 + [False] + [True] * 5 + [False] + [True] * 5 + [False]
    assert default_selection_layers(gemma) == [5]


def test_kivi_packing_and_error():
    torch.manual_seed(0)
    for bits in (2, 4):
        codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
        packed = pack(codes, bits)
        assert packed.shape == (3, 5, 64 * bits // 8)
        assert torch.equal(unpack(packed, bits), codes)
        x = torch.randn(4, 32, 64)
        c, lo, step = quantize(x, bits, dim=-2)
        back = c.float() * step.float()[:, None] + lo.float()[:, None]
        assert (back - x).abs().max() <= step.float().max() * 0.51 + 1e-3


def test_kv_quant_bytes_under_35_percent_of_bfloat16():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                      eos_token_id=None, pad_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    prompt = _prompt(3000, seed=3)  # long enough that the full-precision window (32-63 tokens) is small
    full = _run(model, prompt, new=8)
    q4 = _run(model, prompt, make_policy("kv_quant"), new=8)
    q2 = _run(model, prompt, make_policy("kv_quant:bits=2"), new=8)
    assert q4.kv_bytes <= 0.35 * full.kv_bytes, (q4.kv_bytes, full.kv_bytes)
    assert q2.kv_bytes < q4.kv_bytes


def test_budget_and_policy_errors():
    assert Budget.parse("0.25").for_length(1000) == 250
    assert Budget.parse("512").for_length(1000) == 512
    assert Budget.parse(0.1).ratio == 0.1
    for bad in ("0", "1.5", "-3", "abc", ""):
        with pytest.raises(SpeculumError):
            Budget.parse(bad)
    with pytest.raises(SpeculumError):
        make_policy("nope")
    with pytest.raises(SpeculumError):
        make_policy("kv_quant:bits=3")
    with pytest.raises(SpeculumError):
        make_policy("tidal:oops")
    assert make_policy("full") is None
    assert set(POLICIES) == set(SPECS) | set(TESTED_ELSEWHERE)


def test_ruler_tasks_and_scoring():
    from speculum.bench.ruler import TASKS, make_task, string_match_all

    count = lambda text: len(text.split())
    for task in TASKS:
        a, b = make_task(task, 600, 0, count), make_task(task, 600, 0, count)
        assert a == b  # fixed seeds
        assert all(e in a.context for e in a.expected) or task == "common_words"
        assert 450 <= count(a.context) <= 700
    assert string_match_all("the numbers are 123 and 456", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5


@pytest.mark.slow
def test_packaged_models_through_every_policy(smollm2_f32, gemma3_f32):
    """Real weights, float32: with a covering budget every policy decodes exactly as without one,
    SmolLM2 on a chat prompt and Gemma-3 on a prompt past its 512-token window."""
    from speculum.prompts import encode_prompt

    for (model, tok), text in [(smollm2_f32, "List five animals that live in the ocean and say one fact about each."),
                               (gemma3_f32, "The old lighthouse keeper wrote in his log every night. " * 60)]:
        ids = encode_prompt(tok, text)
        base = _run(model, ids, new=24)
        for spec in SPECS:
            spec += ":residual=100000" if spec == "kv_quant" else ""
            r = _run(model, ids, make_policy(spec, "100000"), new=24)
            assert r.tokens == base.tokens, spec


def test_h2o_accepted_draft_tokens_vote():
    """Under speculation every committed row adds its attention to H2O's scores, accepted draft
    tokens included: with a budget that evicts nothing, the scores after tree steps equal those
    after plain decoding of the same tokens (rejected siblings do not vote)."""
    from speculum.runners import PolicyRunner
    from speculum.tree import DraftTree

    model = tiny_llama(layers=4)
    prompt = _prompt(30, seed=6)
    text = _run(model, prompt, new=36).tokens
    runner = PolicyRunner(runner_for(model, "native"), make_policy("h2o", "100000"))
    rng = random.Random(7)

    def scores(chunks):
        cache = runner.new_cache(128)
        runner.prefill(cache, prompt[:-1])
        root, at = prompt[-1], 0
        for k in chunks:
            accepted = text[at:at + k]
            toks, parents, path, prev = [], [], [], -1
            for tok in accepted:  # the accepted chain, with a rejected sibling before each node
                toks.append((tok + 1 + rng.randrange(TINY_VOCAB - 1)) % TINY_VOCAB)
                parents.append(prev)
                toks.append(tok)
                parents.append(prev)
                prev = len(toks) - 1
                path.append(prev + 1)
            runner.forward(cache, root, DraftTree(toks, parents))
            runner.commit(cache, [0] + path)
            root, at = text[at + k], at + k + 1
        return cache.score[:, :, : cache.length], cache.length

    plain, n_plain = scores([0] * 26)  # 26 steps of one token
    spec, n_spec = scores([3, 0, 5, 2, 1, 4, 0, 3])  # 8 steps: 18 accepted + 8 bonus tokens
    assert n_plain == n_spec == len(prompt) - 1 + 26
    torch.testing.assert_close(spec, plain, atol=1e-5, rtol=1e-4)


def test_rolled_keys_equal_keys_roped_at_their_new_positions():
    from speculum.attention import Rotary, rotate

    torch.manual_seed(0)
    rot = Rotary(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    raw = torch.randn(3, 40, 16)  # [H_kv, m, d]
    old = torch.arange(100, 140)
    new = torch.arange(40)

    def roped(pos):
        cos, sin = rot.cos_sin(pos, torch.float32)  # [m, 1, d]
        return rotate(raw, cos[:, 0], sin[:, 0])

    torch.testing.assert_close(rot.shift(roped(old), new - old), roped(new), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rolling", [True, False])
def test_streaming_runs_past_the_context_with_flat_memory(rolling):
    """StreamingLLM's positions live inside the cache: a tiny model with a 256-token context streams
    768 tokens (3x) in one request, its cache never beyond the budget plus slack; with text positions
    (``rolling=0``) the same request stops at the context."""
    model = tiny_llama(layers=2)
    policy = make_policy(f"streaming:rolling={int(rolling)}", "48")
    out = _run(model, _prompt(40, seed=8), policy, new=768)
    per_entry = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
    if rolling:
        assert out.finish_reason == "length" and out.new_tokens == 768
        assert out.kv_bytes <= (48 + policy.slack(48) + 1) * per_entry
    else:
        assert out.finish_reason == "context" and 40 + out.new_tokens == 256
