"""Self-drafters (``swift``, ``quant_self``, ``kv_draft``): lossless greedy output for chains, trees and
sized trees on tiny Llama and Gemma-3 past its window, alone and batched; sampled output with the
target's distribution; the quantized linear layers; the layer-set search; clear refusals."""

import math
import random
from collections import Counter

import pytest
import torch
from conftest import TINY_VOCAB, batched_join_midway, tiny_gemma3, tiny_llama
from test_sampling import PARAMS, VOCAB, chi2_pvalue, exact_joint, sample_pairs

from speculum.attention import grouped
from speculum.cache.store import FunctionStore
from speculum.drafters import DRAFTERS
from speculum.drafters.kv_draft import kv_draft_options
from speculum.drafters.ngram import NgramDrafter
from speculum.drafting import self_forward as self_draft_runner
from speculum.drafting.quantized_copy import (
    DraftNorm,
    QuantLinear,
    TrimmedHead,
    linear_weight,
    quantized_head,
)
from speculum.drafting.tree_growth import DynamicTree
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import make_policy
from speculum.kv.scoring import page_bounds
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.runners.decoder import Linear, RMSNorm
from speculum.tree_sizing import CostModel

# (drafter, options): every self-drafter and its variants; kv_draft's window is far shorter than the sequences
KINDS = {
    "swift": ("swift", {"min_context": 4, "search_rows": 12, "search_trials": 8}),
    "swift_fixed": ("swift", {"skip": [1]}),
    "quant_self_int4": ("quant_self", {"bits": 4}),
    "quant_self_int8": ("quant_self", {"bits": 8}),
    "kv_draft": ("kv_draft", {"sink": 2, "window": 6, "bits": 16}),
    "kv_draft_int4": ("kv_draft", {"sink": 1, "window": 9, "bits": 4}),
    "kv_draft_snapkv": ("kv_draft", {"policy": "snapkv", "sink": 1, "window": 4, "selected": 3, "observe": 4}),
    "kv_draft_quest": ("kv_draft", {"policy": "quest", "sink": 1, "window": 4, "pages": 2, "page": 3}),
    # a trimmed LM head: a third of the vocabulary, plus each request's prompt tokens
    "quant_self_trimmed": ("quant_self", {"bits": 4, "trim_vocab": torch.arange(0, TINY_VOCAB, 3)}),
    "kv_draft_snapkv_trimmed": ("kv_draft", {"policy": "snapkv", "sink": 1, "window": 4, "selected": 3, "observe": 4,
                                             "bits": 4, "trim_vocab": torch.arange(1, TINY_VOCAB, 3)}),
}


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def make_llama():
    return tiny_llama(layers=4)


SHAPES = {"chain": {"top_k": 1}, "tree": {"top_k": 4, "max_nodes": 16},
          "sized_tree": {"top_k": 8, "max_nodes": 40, "sized": True}}
# every kind as a chain; trees once per code path (the view, the weights and the layers differ, not the tree)
CASES = [(k, "chain") for k in KINDS] + [(k, t) for k in ("swift", "quant_self_int4", "kv_draft_snapkv", "kv_draft_quest",
                                                              "quant_self_trimmed") for t in ("tree", "sized_tree")]


@pytest.mark.parametrize("kind,shape", CASES)
@pytest.mark.parametrize("make", [make_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_greedy_self_drafts_equal_ar(kind, make, shape):
    model = make()
    name, options = KINDS[kind]
    ar = build_method("ar", model, None)
    shape = dict(SHAPES[shape])
    sized = shape.pop("sized", False)
    cost = CostModel([1, 16, 64], [64], [[0.01, 0.012, 0.03]]) if sized else None
    method = build_method(name, model, None, sized=sized, cost_model=cost, exit_confidence=0.0, **shape, **options)
    drafted = accepted = 0
    for p in prompts(1):
        assert method.run(p, 48).tokens == ar.run(p, 48).tokens
        steps = method.run(p, 48).steps
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert drafted > 0 and accepted > 0


def test_lookup_continuation_is_what_followed_the_chain_before():
    text = NgramDrafter(max_ngram=3, min_ngram=2)
    text.reset([5, 6, 7, 8, 5], None, None)
    assert text.continuation([5, 6, 7, 8, 5], [6], 8) == [7, 8, 5]  # (5, 6) occurred at the start
    assert text.continuation([5, 6, 7, 8, 5], [6], 2) == [7, 8]
    assert text.continuation([5, 6, 7, 8, 5], [9], 8) == []  # (5, 9) did not
    assert text.continuation([5, 6, 7, 8, 5, 6], [], 8) == [7, 8, 5, 6]  # committed tokens only: as ngram
    grow = DynamicTree(1)
    grow.add_path(-1, [3, 4], 0.5)
    assert grow.parents == [-1, 0] and grow.scores == pytest.approx([math.log(0.5), 2 * math.log(0.5)])


@pytest.mark.parametrize("name,options", [("quant_self", {"bits": 4}),
                                          ("kv_draft", {"policy": "snapkv", "sink": 1, "window": 4, "selected": 3,
                                                        "observe": 4})])
def test_looked_up_chains_equal_ar(name, options):
    """One draft forward a step (``depth=1``): any further drafted token came from the lookup; on
    prompts that repeat, some steps take them, and the output is still ``ar``'s."""
    model = make_llama()
    ar = build_method("ar", model, None)
    method = build_method(name, model, None, depth=1, exit_confidence=0.0, sized=False, lookup=6, **options)
    rng = random.Random(4)
    longest = 0
    for _ in range(4):
        motif = [rng.randrange(TINY_VOCAB) for _ in range(5)]
        p = motif * 4 + [rng.randrange(TINY_VOCAB) for _ in range(3)] + motif[:2]
        r = method.run(p, 40)
        assert r.tokens == ar.run(p, 40).tokens
        longest = max([longest] + [s.drafted for s in r.steps])
    assert 1 < longest <= 7
    no_lookup = build_method(name, model, None, depth=1, exit_confidence=0.0, sized=False, lookup=0, **options)
    assert max(s.drafted for s in no_lookup.run(p, 40).steps) == 1


def test_quantized_drafts_are_mostly_accepted():
    """An int8 copy of the target agrees with it far more often than chance (the point of quant_self)."""
    model = make_llama()
    method = build_method("quant_self", model, None, bits=8, exit_confidence=0.0, sized=False)
    drafted = accepted = 0
    for p in prompts(5):
        steps = method.run(p, 40).steps
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert accepted / drafted > 0.6


@pytest.mark.parametrize("kind,top_k", [("swift", 3), ("quant_self_int4", 3), ("kv_draft", 3), ("kv_draft_snapkv", 3),
                                        ("quant_self_int4", 1)])  # chains: each request's own lookup
def test_batched_self_drafts_equal_solo(kind, top_k):
    """Several requests in one forward per step, joining mid-way, each drafting over its own pool slot."""
    model = make_llama()
    name, options = KINDS[kind]
    runner = NativeRunner(model)
    drafter = DRAFTERS[name].factory(target=model, draft_head=None, top_k=top_k, max_nodes=8, **options)
    engine = Engine(runner, drafter, eos_token_ids=[])
    ar = build_method("ar", model, None, runner=runner)
    ps = prompts(2, n=5)
    assert batched_join_midway(runner, engine, ps) == [ar.run(p, 40).tokens for p in ps]


@pytest.mark.parametrize("kind", ["swift_fixed", "kv_draft", "quant_self_trimmed"])  # quant_self: the same chain code
def test_sampled_self_drafts_keep_the_target_distribution(kind):
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0, layers=3)
    name, options = KINDS[kind]
    options = {**options, "window": 1, "sink": 1} if name == "kv_draft" else options
    if "trim_vocab" in options:  # half of this model's vocabulary (q is zero on the other half)
        options = {**options, "trim_vocab": torch.arange(0, VOCAB, 2)}
    drafter = DRAFTERS[name].factory(target=model, draft_head=None, exit_confidence=0.0, **options)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    n = 6000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=100), exact_joint(model), n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_sampled_chains_with_looked_up_tokens_keep_the_target_distribution():
    """A prompt whose 2-grams recur: a drawn token after its last token is often looked up (a
    point-mass proposal); the first two of three sampled tokens still follow the target's joint
    distribution."""
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0, layers=3)
    prompt = [1, 5, 2, 6, 5, 0, 4, 5, 7, 1, 5]  # (5, x) is followed by a token for x in 2, 0, 7
    with torch.no_grad():
        p1 = PARAMS.probs(model(torch.tensor([prompt])).logits[0, -1])
        p2 = PARAMS.probs(model(torch.tensor([prompt + [a] for a in range(VOCAB)])).logits[:, -1])
    exact = {(a, b): float(p1[a] * p2[a, b]) for a in range(VOCAB) for b in range(VOCAB)}
    drafter = DRAFTERS["quant_self"].factory(target=model, draft_head=None, exit_confidence=0.0, bits=8)
    found = []
    look_up = drafter.text.continuation
    drafter.text.continuation = lambda *args: found.append(look_up(*args)) or found[-1]
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    n = 4000
    counts = Counter(tuple(engine.generate(prompt, 3, PARAMS, seed=500 + i).tokens[:2]) for i in range(n))
    assert sum(map(bool, found)) > n / 10  # proposals taken from the text
    p = chi2_pvalue(counts, exact, n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_trimmed_head_scores_its_tokens_as_the_whole_head_does():
    """A trimmed head's logits are the whole quantized head's on the tokens it covers (rows are
    quantized one by one), -inf elsewhere; a request's tokens join the covered ones."""
    model = make_llama()
    dec = NativeRunner(model).decoder
    full = quantized_head(dec, 4)
    head = TrimmedHead(dec, 4, torch.tensor([5, 3, 3, 40, 7]))
    x = torch.randn(3, dec.shape.hidden)
    ref = full(x)
    for h, covered in ((head, [3, 5, 7, 40]), (head.with_tokens([7, 9, 90, 10**6]), [3, 5, 7, 9, 40, 90])):
        out = h(x)
        assert out.shape == ref.shape and h.covers() == len(covered)
        assert torch.allclose(out[:, covered], ref[:, covered], atol=1e-5)
        rest = torch.ones(ref.shape[1], dtype=torch.bool)
        rest[covered] = False
        assert bool(torch.isneginf(out[:, rest]).all())


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_draft_norm_is_the_rms_norm(dtype, atol):
    weight = torch.rand(64) + 0.5
    x = torch.randn(3, 5, 64).to(dtype) * 3
    for gemma in (False, True):
        norm = RMSNorm(weight.to(dtype), 1e-6, gemma)
        assert torch.allclose(DraftNorm(norm)(x).float(), norm(x).float(), atol=atol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_its_dequantized_weights(bits, dtype):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    q = QuantLinear(w, b, bits)
    assert q.kernel is not None  # the CPU kernels run
    x = torch.randn(5, 64, dtype=dtype)
    ref = QuantLinear(w, b, bits)
    ref.kernel = None
    ref.dequantized = _dequantized(w, bits).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(q(x).float(), ref(x).float(), atol=tol * 8, rtol=tol)
    assert (q(x).float() - x.float() @ w.float().t() - b.float()).abs().mean() < (0.3 if bits == 4 else 0.05) * 8


def _dequantized(w: torch.Tensor, bits: int) -> torch.Tensor:
    w = w.float()
    if bits == 8:
        s = w.abs().amax(1, keepdim=True) / 127
        return torch.round(w / s).clamp(-127, 127) * s
    g = w.view(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return (torch.round((g - lo) / s).clamp(0, 15) * s + lo).view_as(w)


@pytest.mark.parametrize("dtype, shape, atol", [(torch.bfloat16, (48, 32), 0.05), (torch.float32, (1024, 512), 1e-5)])
def test_linear_weight_reads_back_a_packed_weight(dtype, shape, atol):
    """Read back from the packed copy (bfloat16; float32 from MIN_FLOAT32_PACKED weights), or the plain one."""
    torch.manual_seed(0)
    w, b = torch.randn(*shape, dtype=dtype), torch.randn(shape[0], dtype=dtype)
    assert torch.equal(linear_weight(Linear(w.clone())), w)
    torch.testing.assert_close(linear_weight(Linear(w.clone(), b)), w, atol=atol, rtol=0)


def test_swift_searches_a_layer_set_once_and_shares_it():
    model = tiny_llama(layers=6)
    drafter = DRAFTERS["swift"].factory(target=model, draft_head=None, min_context=8, search_rows=16,
                                        search_trials=12)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    engine.generate(prompts(3, 1)[0] + list(range(20)), 8)
    found = dict(drafter.found)
    assert set(found) == {"skip", "match", "cost", "worth"}
    assert found["skip"] and all(0 < i < 5 for i in found["skip"])  # first and last layers kept
    assert 0 < found["cost"] < 1 and 0.0 <= found["match"] <= 1.0
    twin = drafter.fork()
    Engine(NativeRunner(model), twin, eos_token_ids=[]).generate(list(range(30)), 8)
    assert twin.found is drafter.found and drafter.found["skip"] == found["skip"]
    assert drafter.worth(0.9, 0.5) > drafter.worth(0.5, 0.5) > drafter.worth(0.5, 0.9)


def test_self_drafts_refuse_what_they_cannot_run():
    model = make_llama()
    with pytest.raises(SpeculumError, match="skips layers among"):
        build_method("swift", model, None, skip=[7])
    with pytest.raises(SpeculumError, match="kv-draft policy"):
        build_method("kv_draft", model, None, policy="kivi")
    assert kv_draft_options("snapkv:trim=0,bits=8") == {"policy": "snapkv", "trim": 0, "bits": 8}
    with pytest.raises(SpeculumError, match="option trim"):
        kv_draft_options("snapkv:trim=2")
    with pytest.raises(SpeculumError, match="lookup is a number of tokens"):
        build_method("kv_draft", model, None, **kv_draft_options("snapkv:lookup=-1"))
    with pytest.raises(ValueError, match="token ids"):
        TrimmedHead(NativeRunner(model).decoder, 4, torch.tensor([5, TINY_VOCAB]))
    method = build_method("quant_self", model, None, kv_policy=make_policy("streaming", "16"))
    with pytest.raises(SpeculumError, match="plain cache"):
        method.run(list(range(20)), 8)


def _view_drafter_equals_ar(model, prompt: list[int], **view):
    """A ``kv_draft`` drafter with ``view`` (the target's own weights) after a request on ``prompt``
    whose output must equal ``ar``'s; returns it and the model's full-attention layers."""
    drafter = DRAFTERS["kv_draft"].factory(target=model, sink=1, window=4, bits=16, **view)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    assert engine.generate(prompt, 24).tokens == build_method("ar", model, None).run(prompt, 24).tokens
    return drafter, [i for i, layer in enumerate(drafter.decoder.layers) if not layer.sliding]


@pytest.mark.parametrize("make", [make_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_snapkv_view_picks_entries_on_full_attention_layers(make):
    drafter, full_layers = _view_drafter_equals_ar(make(), prompts(4, 1)[0] + list(range(20)),
                                                   policy="snapkv", selected=3, observe=4)
    picked = drafter.model.picked
    assert sorted(picked) == full_layers
    s = drafter.decoder.shape
    assert all(k.shape == v.shape == (s.kv_heads, 3, s.head_dim) for k, v in picked.values())


def test_snapkv_selection_is_the_observation_windows_top_entries():
    """The entries a snapkv view picks (at the end of the prefill) are the top ``selected`` per KV head
    by the attention the prompt's last ``observe`` tokens pay them, scored against transformers' own
    attention weights (float32, the target's weights drafting)."""
    model = make_llama()
    model.config._attn_implementation = "eager"
    sink, window, selected, observe = 1, 4, 5, 6
    drafter = DRAFTERS["kv_draft"].factory(target=model, policy="snapkv", sink=sink, window=window,
                                           selected=selected, observe=observe, bits=16)
    prompt = prompts(1, 7)[0] + [random.Random(8).randrange(TINY_VOCAB) for _ in range(40)]
    Engine(NativeRunner(model), drafter, eos_token_ids=[]).generate(prompt, 1)
    length = len(prompt) - 1
    start, lo, hi = length - observe, sink, length - window
    with torch.inference_mode():
        attn = model(torch.tensor([prompt[:-1]]), output_attentions=True).attentions  # per layer [1, H, T, T]
    s = drafter.decoder.shape
    slots = drafter.model.picked_slots
    assert sorted(slots) == list(range(s.layers))
    for i, a in enumerate(attn):
        got = a[0, :, start:length].sum(1).view(s.kv_heads, s.group, length).sum(1)  # [H_kv, length]
        pooled = torch.nn.functional.max_pool1d(got[:, None, lo:hi], 7, 1, 3)[:, 0]
        for h in range(s.kv_heads):
            chosen = slots[i][h] - lo
            assert len(set(chosen.tolist())) == selected and chosen.min() >= 0 and chosen.max() < hi - lo
            rest = torch.ones(hi - lo, dtype=torch.bool)
            rest[chosen] = False
            assert pooled[h, chosen].min() >= pooled[h, rest].max() - 1e-5


def _view_reference(draft, ids: list[int]) -> torch.Tensor:
    """Logits ``[n, V]`` of draft rows ``ids`` after the committed tokens, each row seeing the rows
    before it, computed by gathering from the target's cache what the view reads: the first
    ``sink`` slots, the selected ones, then every slot from ``recent`` on (Llama: full attention
    only)."""
    dec, v, cache = draft.decoder, draft.view, draft.cache
    kv, length, n = cache.kv, cache.length, len(ids)
    d = dec.shape.head_dim

    def gathered(i, sliding, q, k, val):  # a KVStore's attend reading the view's slots from the target's cache
        slots = [torch.arange(v.sink).expand(dec.shape.kv_heads, -1)]
        if draft.picked_slots:
            slots.append(draft.picked_slots[i])
        slots.append(torch.arange(draft.recent, length).expand(dec.shape.kv_heads, -1))
        idx = torch.cat(slots, dim=1)[..., None].expand(-1, -1, d)  # [H_kv, S, d]
        keys = torch.cat([kv[i, 0].gather(1, idx), k.transpose(0, 1)], dim=1)
        values = torch.cat([kv[i, 1].gather(1, idx), val.transpose(0, 1)], dim=1)
        mask = torch.cat([torch.ones(n, idx.shape[1], dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        return dec.attend(q, keys, values, grouped(mask, dec.shape.group, dec.dtype))

    with torch.inference_mode():
        return dec.forward_with(torch.tensor(ids), torch.arange(length, length + n), FunctionStore(gathered)).logits


@pytest.mark.parametrize("slack", [None, 0], ids=["spare", "growing"])
@pytest.mark.parametrize("policy,new", [("snapkv", 20), ("streaming", 90)])
def test_view_buffer_holds_what_the_view_reads(policy, new, slack, monkeypatch):
    """A streaming or snapkv view's draft rows read its own buffer: their logits are those of
    attention over the view's entries gathered from the target's cache (float32), after tokens were
    committed past the selection, past a streaming window's restart, and with the buffer growing."""
    if slack is not None:
        monkeypatch.setattr(self_draft_runner, "BUFFER_SLACK", slack)
    model = make_llama()
    window = 4
    drafter = DRAFTERS["kv_draft"].factory(target=model, policy=policy, sink=1, window=window, selected=3, observe=4,
                                           bits=16)
    prompt = prompts(4, 1)[0] + list(range(20))
    out = Engine(NativeRunner(model), drafter, eos_token_ids=[]).generate(prompt, new)
    assert out.tokens == build_method("ar", model, None).run(prompt, new).tokens
    draft, cache = drafter.model, drafter.target_cache
    length = cache.length
    draft.begin(cache, 3)
    assert draft.buffer is not None and draft.buffer.synced == length
    if policy == "streaming":
        assert draft.recent > len(prompt) - 1 - window  # the window restarted during the request
        assert length - draft.recent <= window + self_draft_runner.REBASE_SLACK
    else:
        assert draft.recent < len(prompt) - 1 and draft.picked_slots
    ids = [5, 9, 2]
    got = [draft.run(torch.tensor([t]), torch.tensor([length + r]), torch.ones(1, r + 1, dtype=torch.bool))
           for r, t in enumerate(ids)]
    torch.testing.assert_close(torch.cat(got), _view_reference(draft, ids), rtol=1e-5, atol=1e-5)


def test_quest_page_bounds_bound_every_score():
    """Quest's page bound (two products) is the elementwise ``sum_c max(q_c min_c, q_c max_c)`` and
    is at least every attention logit of the page's keys."""
    torch.manual_seed(0)
    kv_heads, rows, d, pages, page = 2, 5, 8, 6, 4
    qg, keys = torch.randn(kv_heads, rows, d), torch.randn(kv_heads, pages, page, d)
    kmin, kmax = keys.amin(2), keys.amax(2)  # [H_kv, P, d]
    got = page_bounds(qg, kmin, kmax)  # [H_kv, R, P]
    want = torch.maximum(qg[:, :, None] * kmin[:, None], qg[:, :, None] * kmax[:, None]).sum(-1)
    torch.testing.assert_close(got, want)
    logits = torch.einsum("hrd,hpkd->hrpk", qg, keys)  # every key's logit
    assert (got[..., None] >= logits - 1e-5).all()


@pytest.mark.parametrize("make", [make_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_quest_view_reads_pages_on_full_attention_layers(make):
    prompt = prompts(4, 1)[0] + list(range(30))
    drafter, full_layers = _view_drafter_equals_ar(make(), prompt, policy="quest", pages=2, page=3)
    bounds = drafter.model.bounds
    assert sorted(bounds) == full_layers
    s = drafter.decoder.shape
    count = (len(prompt) - 1 - 4 - 1) // 3  # whole pages between the sink and the window, after the prefill
    assert all(lo.shape == hi.shape == (s.kv_heads, count, s.head_dim) for lo, hi in bounds.values())
    q = torch.randn(2, s.heads, s.head_dim)
    slots = drafter.model._pages(full_layers[0], q)
    assert slots.shape == (s.kv_heads, 2 * 3) and slots.min() >= 1 and slots.max() < 1 + 3 * count
