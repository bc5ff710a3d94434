"""Keyformer, D2O and Chelsea (speculum.kv.keyformer, .d2o, .chelsea): each keeps or merges what its
paper's rule says, a covering budget is exactly plain decoding, and a lossy budget holds less.

- Constructed examples: Keyformer's keyed Gumbel noise and temperature schedule, its selection, and
  its votes under tree speculation equal to one-token steps'; D2O's merge of an evicted token into
  its most similar kept one above the moving threshold; Chelsea's chunked soft matching, and its
  log-size bias reproducing full attention exactly when a cluster's keys are equal.
- The layer-wise prefill's ``"logits"`` kind: a softmax vote gives the ``"all"`` scores, and
  Keyformer's prefill scores do not depend on the prefill's chunking.
- Every model-free drafter equals plain decoding under a covering budget (tiny Llama and tiny
  Gemma-3), and equals ``ar`` under a lossy budget: Chelsea merges at prefill only; Keyformer and
  D2O also evict while decoding, where the engine trims each tree at the next eviction and their
  votes and merges depend on positions, not on steps.
"""

import math
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_gemma3, tiny_llama
from kv_lossless import ar_tokens, assert_drafters_equal_ar, lookup_prompt

from speculum.attention import AttentionLayout, Step
from speculum.cache import MergedKVCache, PositionedKVCache
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import make_policy
from speculum.kv.chelsea import ChelseaPolicy, cluster_chunks, plan
from speculum.kv.d2o import D2OState
from speculum.kv.keyformer import keyed_gumbel
from speculum.runners import PolicyRunner, runner_for, under_policy
from speculum.runners.layerwise import prefill_layerwise
from speculum.tree import DraftTree

SPECS = ["keyformer", "d2o", "chelsea"]
# decode-time eviction included: the engine trims each tree at the policy's next eviction (draft_depth)
STEP_INVARIANT = ["keyformer", "d2o", "chelsea", "keyformer:decode=0", "d2o:decode=0"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return tiny_llama(layers=6) if request.param == "llama" else tiny_gemma3()


def _run(model, prompt, policy=None, drafter=None, new=32):
    engine = Engine(under_policy(runner_for(model, "native"), policy), drafter or AutoregressiveDrafter(), eos_token_ids=[])
    return engine.generate(prompt, new)


# -- every drafter, covering and lossy budgets ----------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_covering_budget_is_plain_decoding(tiny, spec):
    prompt = lookup_prompt(60)
    assert_drafters_equal_ar(tiny, spec, "100000", prompt, plain=ar_tokens(tiny, prompt))


@pytest.mark.parametrize("spec", STEP_INVARIANT)
def test_every_drafter_equals_ar_under_a_lossy_policy(tiny, spec):
    assert_drafters_equal_ar(tiny, spec, "12", lookup_prompt(60))


@pytest.mark.parametrize("spec", SPECS)
def test_lossy_budget_holds_less(tiny, spec):
    """Decode-time eviction included (keyformer, d2o): plain and tree steps run to the end and hold less."""
    prompt = lookup_prompt(60, seed=1)
    base = _run(tiny, prompt)
    r = _run(tiny, prompt, make_policy(spec, "12"))
    tree = _run(tiny, prompt, make_policy(spec, "12"), OracleDrafter(base.tokens, TINY_VOCAB, shape="tree", seed=4))
    assert r.new_tokens == tree.new_tokens == 32
    assert r.kv_bytes < 0.6 * base.kv_bytes and tree.kv_bytes < 0.6 * base.kv_bytes


# -- Keyformer -------------------------------------------------------------------------------------

def test_keyed_gumbel_is_gumbel_and_keyed_by_position():
    g = keyed_gumbel(0, 3, torch.arange(300), torch.arange(300), 1, 1)  # 90k draws
    assert g.shape == (1, 300, 300)
    assert abs(float(g.mean()) - 0.5772) < 0.02 and abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.02
    # the noise of (query position, key position) does not depend on which other rows or keys come along
    part = keyed_gumbel(0, 3, torch.tensor([7, 250]), torch.tensor([5, 299]), 1, 1)
    assert torch.equal(part[0], g[0][[7, 250]][:, [5, 299]])
    # folded rows: query head j of KV head h is head h*g + j; every key of the seed, layer and head matters
    two = keyed_gumbel(0, 3, torch.arange(4), torch.arange(9), 2, 3)  # [2, 3*4, 9]
    assert two.shape == (2, 12, 9)
    assert len({round(float(x), 6) for x in two[:, :, 0].flatten()}) == 24
    assert not torch.equal(keyed_gumbel(1, 3, torch.arange(4), torch.arange(9), 2, 3), two)
    assert not torch.equal(keyed_gumbel(0, 4, torch.arange(4), torch.arange(9), 2, 3), two)


def test_keyformer_temperature_and_selection():
    policy = make_policy("keyformer:steps=10,tau_init=1,tau_end=3", "10")
    state = SimpleNamespace(start=40, steps=10)
    tau = policy.tau(state, torch.tensor([0, 39, 40, 44, 49, 60]))
    torch.testing.assert_close(tau, torch.tensor([1.0, 1.0, 1.2, 2.0, 3.0, 3.0]))
    # recent_ratio 0.3 of 10: the last 3 tokens, and the 7 best-scored of the others
    scores = torch.zeros(2, 40)
    scores[0, [1, 5, 9, 13, 17, 21, 25]] = 1.0
    scores[1, [30, 31, 32, 33, 34, 35, 36]] = 1.0
    idx = policy.select_prefill(torch.zeros(2, 2, 40, 4), scores, 10)
    assert idx.tolist() == [[1, 5, 9, 13, 17, 21, 25, 37, 38, 39], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]


def test_keyformer_scores_are_a_noisy_tempered_softmax():
    policy = make_policy("keyformer:seed=5", "10")
    logits = torch.randn(2, 6, 7)  # [H_kv, g*r, L], g = 3, r = 2
    logits[:, :, 6] = float("-inf")  # a masked key gets nothing
    q_pos, k_pos, tau = torch.tensor([4, 5]), torch.arange(7), torch.tensor([1.0, 2.0])
    want = ((logits + keyed_gumbel(5, 1, q_pos, k_pos, 2, 3)) / tau.repeat(3)[None, :, None]).softmax(-1).sum(1)
    got = policy.scores(1, logits.clone(), q_pos, k_pos, tau)
    torch.testing.assert_close(got, want)
    assert torch.all(got[:, 6] == 0) and torch.allclose(got.sum(-1), torch.full((2,), 6.0))


def test_logits_kind_matches_all_and_keyformer_prefill_ignores_chunking():
    decoder = runner_for(tiny_llama(layers=2), "native").decoder
    ids = [random.Random(0).randrange(TINY_VOCAB) for _ in range(70)]

    def scores(kind, chunk, vote=None):
        out = {}
        prefill_layerwise(decoder, ids, chunk, kind, 0, lambda i, s, kv, sc: out.update({i: sc}), vote)
        return out

    softmax_vote = lambda layer, logits, positions: logits.softmax(-1).sum(1)
    full, voted = scores("all", 16), scores("logits", 16, softmax_vote)
    for i in full:
        torch.testing.assert_close(voted[i], full[i])
    policy = make_policy("keyformer", "10")
    keyformer_vote = lambda layer, logits, positions: policy.prefill_vote(None, layer, logits, positions)
    a, b = scores("logits", 16, keyformer_vote), scores("logits", 64, keyformer_vote)
    for i in a:
        torch.testing.assert_close(a[i], b[i], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(a[i], full[i], atol=1e-3)  # the noise is there


def test_keyformer_accepted_draft_tokens_vote_as_in_one_token_steps():
    """With a budget that evicts nothing, Keyformer's scores after tree steps (a rejected sibling
    before every accepted node) equal those after one-token steps of the same text: the noise and
    the temperature are keyed by position, not by step."""
    model = tiny_llama(layers=4)
    prompt = lookup_prompt(30, seed=6)
    text = _run(model, prompt, new=36).tokens
    runner = PolicyRunner(runner_for(model, "native"), make_policy("keyformer:steps=20", "100000"))
    rng = random.Random(7)

    def scores(chunks):
        cache = runner.new_cache(128)
        runner.prefill(cache, prompt[:-1])
        root, at = prompt[-1], 0
        for k in chunks:
            toks, parents, path, prev = [], [], [], -1
            for tok in text[at:at + k]:
                toks += [(tok + 1 + rng.randrange(TINY_VOCAB - 1)) % TINY_VOCAB, tok]
                parents += [prev, prev]
                prev = len(toks) - 1
                path.append(prev + 1)
            runner.forward(cache, root, DraftTree(toks, parents))
            runner.commit(cache, [0] + path)
            root, at = text[at + k], at + k + 1
        return cache.score[:, :, : cache.length]

    torch.testing.assert_close(scores([3, 0, 5, 2, 1, 4, 0, 3]), scores([0] * 26), atol=1e-5, rtol=1e-4)


# -- D2O ---------------------------------------------------------------------------------------------

def test_d2o_merges_an_evicted_token_into_its_most_similar_kept_one():
    policy = make_policy("d2o:sinks=0", "3")
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.05], [0.7, 0.7], [0.05, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    values = torch.arange(12, dtype=torch.float32).view(6, 2)
    kv = torch.stack([keys, values])[:, None]  # [2, H_kv=1, 6, d=2]
    before = kv.clone()
    cache = SimpleNamespace(state=D2OState(budget=3, kept=3))
    policy.merge_evicted(cache, 0, kv, torch.tensor([[0, 4, 5]]))
    cos = lambda a, b: float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    u1, u2, u3 = cos(keys[1], keys[0]), max(cos(keys[2], keys[0]), cos(keys[2], keys[4])), cos(keys[3], keys[4])
    assert cache.state.threshold[0] == pytest.approx((u1 + u2 + u3) / 3)  # the first eviction's mean
    # t1 joins t0 and t3 joins t4 (similarity above the threshold); t2 (0.707) is dropped
    for kept, joined, u in ((0, 1, u1), (4, 3, u3)):
        want = (math.e * before[:, 0, kept] + math.exp(u) * before[:, 0, joined]) / (math.e + math.exp(u))
        torch.testing.assert_close(kv[:, 0, kept], want)
    assert torch.equal(kv[:, 0, 5], before[:, 0, 5])  # nothing joined t5: its exact bits
    # the threshold moves as a moving average: alpha = 0.5 of the last one
    again = before.clone()
    policy.merge_evicted(cache, 0, again, torch.tensor([[0, 1, 4]]))  # evicts t2, t3, t5
    best = [max(cos(keys[j], keys[c]) for c in (0, 1, 4)) for j in (2, 3, 5)]
    assert cache.state.threshold[0] == pytest.approx(0.5 * (u1 + u2 + u3) / 3 + 0.5 * sum(best) / 3)


def test_d2o_keeps_its_sinks():
    """Half the budget recent, half heavy hitters, the first ``sinks`` tokens always among those."""
    policy = make_policy("d2o:sinks=2", "6")
    scores = torch.arange(20, dtype=torch.float32).expand(1, 20)  # later tokens score higher
    assert policy.select_prefill(torch.zeros(2, 1, 20, 2), scores, 6).tolist() == [[0, 1, 16, 17, 18, 19]]
    assert make_policy("h2o", "6").select_prefill(torch.zeros(2, 1, 20, 2), scores, 6).tolist() == [[14, 15, 16, 17, 18, 19]]


# -- Chelsea -------------------------------------------------------------------------------------------

def test_chelsea_soft_matching_merges_alternate_neighbours():
    torch.manual_seed(0)
    pairs = torch.randn(1, 1, 4, 8)  # one head, one chunk of 8 entries: 4 pairs of equal keys
    keys = pairs.repeat_interleave(2, dim=2)
    values = torch.randn(1, 1, 8, 8)
    alive, k, v, size = cluster_chunks(keys, values, torch.tensor([4]))
    # A = entries 0, 2, 4, 6 each find their equal B neighbour 1, 3, 5, 7 and merge into it
    assert alive[0, 0].tolist() == [False, True] * 4 and size[0, 0].tolist() == [0, 2] * 4
    torch.testing.assert_close(k[0, 0, 1::2], pairs[0, 0])
    torch.testing.assert_close(v[0, 0, 1::2], (values[0, 0, 0::2] + values[0, 0, 1::2]) / 2)
    # a second round on the survivors: down to 2, clusters of 4 (sizes add up)
    alive, _, _, size = cluster_chunks(keys, values, torch.tensor([2]))
    assert int(alive.sum()) == 2 and sorted(size[alive].tolist()) == [4.0, 4.0]


def test_chelsea_plan_shares_the_budget():
    p = plan(59, 12, 16, 6, 2, "cpu")  # 51 tokens between sinks and window; chunks widen until each gets an entry
    whole = 59 - p.chunks * p.chunk
    assert p.start == 2 and int(p.targets.sum()) + whole == 12 and int(p.targets.min()) >= 1
    assert plan(59, 3, 16, 1, 0, "cpu") is not None and plan(59, 1, 16, 0, 0, "cpu") is not None
    assert plan(10, 4, 16, 4, 0, "cpu") is None  # no entry left for a chunk: the caller keeps the recent 4
    assert plan(10, 5, 16, 2, 3, "cpu") is None
    # sinks and window stay single tokens around the merged chunks
    p = plan(20, 10, 4, 4, 2, "cpu")
    assert (p.start, p.chunk, p.chunks, p.targets.tolist()) == (2, 6, 2, [1, 1])
    idx, size = ChelseaPolicy.merge_prefill(torch.randn(2, 3, 20, 4), p)
    assert idx[:, :2].tolist() == [[0, 1]] * 3 and idx[:, -6:].tolist() == [[14, 15, 16, 17, 18, 19]] * 3
    assert size[:, 2:4].tolist() == [[6.0, 6.0]] * 3 and bool((size[:, [0, 1, 4, 5]] == 1).all())


@torch.inference_mode()
def test_chelsea_log_size_bias_reproduces_attention_over_equal_keys():
    """Clusters of equal keys read with ``log size`` added: exactly the attention over every token."""
    torch.manual_seed(1)
    layout = AttentionLayout(layers=1, heads=2, kv_heads=1, head_dim=4, scale=0.5, sliding=(False,))
    keys = torch.randn(1, 8, 4).repeat_interleave(2, dim=1)  # [H_kv, 16, d], equal neighbours
    kv = torch.stack([keys, torch.randn(1, 16, 4)])
    full = PositionedKVCache(layout, torch.float32, "cpu", 32)
    full.reserve(17)
    full.store_layer(0, kv.clone(), None)
    full.length = 16
    policy = make_policy("chelsea:chunk=8,window=0,sinks=0", "8")
    merged = policy.new_cache(layout, torch.float32, "cpu", 32)
    assert isinstance(merged, MergedKVCache)
    policy.begin_prefill(merged, 16)
    policy.store_prefill(merged, 0, False, kv, None)
    policy.end_prefill(merged, 16)
    assert merged.length == 8 and merged.pos[0, 0, :8].tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    torch.testing.assert_close(merged.bias[0, 0, :8], torch.full((8,), math.log(2)))
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    outs = []
    for cache in (full, merged):
        step = Step(torch.tensor([16]), None)
        cache.begin(step.positions)
        outs.append(cache.attend_all(0, False, q, k, v, step))
    torch.testing.assert_close(outs[1], outs[0])
    plain = make_policy("chelsea:chunk=8,window=0,sinks=0,bias=0", "8").new_cache(layout, torch.float32, "cpu", 32)
    assert plain.bias is None


def test_bad_options():
    for spec in ("keyformer:tau_init=0", "keyformer:steps=0", "keyformer:decode=maybe", "d2o:alpha=2",
                 "d2o:sinks=-1", "chelsea:chunk=1", "chelsea:bias=perhaps", "chelsea:nope=1"):
        with pytest.raises(SpeculumError):
            make_policy(spec, "10")
