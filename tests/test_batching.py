"""Continuous batching is lossless: every request's greedy output equals its solo ``ar`` output
(float32), whatever drafters share the batch and however requests join and leave; seeded sampling
gives the solo text; unseeded sampling keeps the target's distribution (chi-square)."""

import random
from collections import Counter

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, random_heads, tiny_llama
from test_sampling import (
    PARAMS,
    PROMPT,
    VOCAB,
    RandomTreeDrafter,
    RejectionVerifier,
    chi2_pvalue,
    exact_joint,
)

from speculum.batching import Batcher, BatchRequest, PrefixCache
from speculum.cache import SlotPool
from speculum.drafters import DRAFTERS
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.auto import AutoDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.engine import Engine
from speculum.runners import NativeRunner, under_policy
from speculum.tree import DraftTree
from speculum.tree_sizing import CostModel, TreeSizer


def _prompts(n, seed, shared=()):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 10))]
        out.append(list(shared) + (base * rng.randint(1, 4))[: rng.randint(1, 40)])
    return out


def test_batched_forward_matches_solo_forwards(tiny_model):
    runner = NativeRunner(tiny_model)
    rng = random.Random(0)
    pool = runner.new_pool(6, capacity=8)  # small: the pool grows during the test
    for trial in range(6):
        prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(2, 5))]
        trees = []
        for _ in prompts:
            k = rng.randint(0, 6)
            trees.append(DraftTree([rng.randrange(TINY_VOCAB) for _ in range(k)], [rng.randrange(i) - 1 if i else -1
                                                                               for i in range(k)]))
        caches = [pool.acquire() for _ in prompts]
        solo = []
        for p, t in zip(prompts, trees):
            c = runner.new_cache(64)
            runner.prefill(c, p[:-1])
            solo.append(runner.forward(c, p[-1], t).logits)
        for c, p in zip(caches, prompts):
            runner.prefill(c, p[:-1])
        if trial % 2:  # free a middle slot: the last sequence moves into it
            victim = caches.pop(1)
            pool.release(victim)
            del solo[1], prompts[1], trees[1]
        order = list(range(len(caches)))
        rng.shuffle(order)  # entries in any slot order
        caches, prompts, trees, solo = ([x[i] for i in order] for x in (caches, prompts, trees, solo))
        # and one more sequence whose prompt is prefilled in the same forward, in two chunks
        extra = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(20, 40))]
        ec, ref = pool.acquire(), runner.new_cache(64)
        runner.prefill(ref, extra[:-1])
        out = runner.forward_batch(caches, [p[-1] for p in prompts], trees, [(ec, extra[:17])])
        runner.forward_batch(caches[:1], [prompts[0][-1]], trees[:1], [(ec, extra[17:-1])])  # the rest
        assert ec.length == len(extra) - 1 and ec.pending == 0
        torch.testing.assert_close(runner.forward(ec, extra[-1], DraftTree()).logits,
                                   runner.forward(ref, extra[-1], DraftTree()).logits, rtol=1e-4, atol=1e-4)
        pool.release(ec)
        for a, b in zip(solo, out):
            torch.testing.assert_close(b.logits, a, rtol=1e-4, atol=1e-4)
        for c in caches:
            pool.release(c)
        assert pool.used == 0


def test_slot_pool_release_keeps_slots_compact():
    pool = SlotPool(1, 1, 2, torch.float32, "cpu", slots=3, capacity=4)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    c.kv[:, :, :, :2] = 7.0
    c.length = 2
    with pytest.raises(RuntimeError, match="in use"):
        pool.acquire()
    pool.release(b)
    assert (a.slot, c.slot) == (0, 1) and float(c.kv[:, :, :, :2].min()) == 7.0
    assert pool.acquire().slot == 2


# a cost model under which drafted rows are cheap for few sequences and dear for many: the batch
# sizer keeps some nodes and drops others
COST = CostModel([1, 16, 64], [64], [[1.0, 1.3, 3.0]], sequences=[1, 4, 16], rows=[1, 8], batch_context=64,
                 batch_seconds=[[1.0, 1.4], [1.2, 2.5], [2.0, 6.0]])


def _engines(runner, model, head):
    """One engine per registered drafter (the scored ones sized by the batch sizer); the learned ones
    with the random head file ``head``."""
    out = {}
    for name, entry in DRAFTERS.items():
        if entry.takes_tokenizers:
            continue  # cross_vocab needs two tokenizers: tests/test_cross_vocab.py batches it
        if entry.needs_draft_model:
            drafter = entry.factory(draft_model=tiny_llama(seed=9))
        elif entry.needs_target:
            drafter = entry.factory(target=model, draft_head=head)
        else:
            drafter = entry.factory()
        out[name] = Engine(runner, drafter, eos_token_ids=[], max_tree=12,
                           sizer=TreeSizer(COST) if entry.scored else None)
    return out


@pytest.mark.parametrize("max_batch", [3, 8])
def test_batch_greedy_equals_solo_ar_for_every_drafter(tiny_model, max_batch, tmp_path):
    """Requests of every drafter share batches; fewer slots than requests, and different lengths,
    so that requests join and leave mid-way. Half of them share a prefix (the prefix cache)."""
    runner = NativeRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    engines = _engines(runner, tiny_model, random_heads(tiny_model, tmp_path))
    shared = [random.Random(5).randrange(TINY_VOCAB) for _ in range(40)]
    prompts = _prompts(12, 1) + _prompts(12, 2, shared)
    rng = random.Random(max_batch)
    reqs, want = [], []
    for i, p in enumerate(prompts):
        n = rng.randint(5, 40)
        want.append(ar.generate(p, n).tokens)
        name = list(engines)[i % len(engines)]
        reqs.append(BatchRequest(engines[name], p, n))
    # an oracle tree drafter (random siblings around the true path) for the deepest trees
    for i, p in enumerate(prompts[:4]):
        ref = ar.generate(p, 30).tokens
        oracle = Engine(runner, OracleDrafter(p + ref, TINY_VOCAB, max_len=10, shape="tree", seed=i),
                        eos_token_ids=[], max_tree=24)
        reqs.append(BatchRequest(oracle, p, 30))
        want.append(ref)
    cache = PrefixCache(min_tokens=8)
    # prompt chunks in their own forward (3 slots) and riding in the decoding steps' forward (8)
    batcher = Batcher(runner, max_batch=max_batch, prefill_chunk=16, prefix_cache=cache, fused_prefill=max_batch > 3)
    got = [r.tokens for r in batcher.run(reqs)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}"
    assert cache.hits > 0 and batcher.pool.used == 0
    # the same prompts again: now every prompt's entries come from the cache, some whole
    again = [BatchRequest(r.engine, r.prompt_ids, r.max_new_tokens) for r in reqs[:len(prompts)]]
    assert [r.tokens for r in batcher.run(again)] == want[:len(prompts)]
    assert any(r.reused == len(r.prompt_ids) - 1 for r in again)


@pytest.mark.parametrize("policy", ["snapkv", "streaming", "kv_quant"])
def test_kv_policy_requests_share_a_batch_with_plain_ones(tiny_model, policy):
    """Requests under a KV policy (a PolicyRunner over the batcher's runner) run beside plain ones:
    each gives the output its engine gives it alone (plain ones ``ar``'s), as requests join and
    leave. (Speculation under a lossy policy need not equal ``ar`` under it: StreamingLLM's window
    moves with each step's length.)"""
    from speculum.kv import make_policy

    runner = NativeRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    ngram = Engine(runner, NgramDrafter(), eos_token_ids=[])
    lossy = Engine(under_policy(runner, make_policy(policy, "16")), AutoregressiveDrafter(), eos_token_ids=[])
    spec = Engine(under_policy(runner, make_policy(policy, "16")), NgramDrafter(), eos_token_ids=[])
    prompts = _prompts(10, 7)
    prompts = [p + p[:8] * 3 for p in prompts]  # past the policy's budget
    reqs, want = [], []
    for i, p in enumerate(prompts):
        engine = [ar, ngram, lossy, spec][i % 4]
        n = 6 + 3 * i
        want.append((ar if engine is ngram else engine).generate(p, n).tokens)
        reqs.append(BatchRequest(engine, p, n))
    batcher = Batcher(runner, max_batch=3, prefill_chunk=16)
    assert [r.tokens for r in batcher.run(reqs)] == want
    assert batcher.pool.used == 0


def test_default_model_batch_equals_solo(smollm2_f32):
    model, tok = smollm2_f32
    import speculum

    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), tok)
    auto = Engine(runner, AutoDrafter(), tok)
    ngram = Engine(runner, NgramDrafter(), tok)
    system = "You are a careful assistant. Answer briefly and exactly. " * 3
    texts = [system + q for q in ("Name three rivers in Europe.", "What is 12 times 12?",
                                  "Repeat: the cat sat on the mat, the cat sat on the mat.")] + ["Write a haiku."]
    prompts = [speculum.encode_prompt(tok, t) for t in texts]
    want = [ar.generate(p, 40).tokens for p in prompts]
    batcher = Batcher(runner, max_batch=3, prefill_chunk=32, prefix_cache=PrefixCache(min_tokens=16))
    reqs = [BatchRequest(auto if i % 2 else ngram, p, 40) for i, p in enumerate(prompts)]
    assert [r.tokens for r in batcher.run(reqs)] == want
    assert batcher.prefix_cache.hits >= 1


def test_batch_seeded_sampling_equals_solo():
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    tree = Engine(runner, RandomTreeDrafter(seed=2), eos_token_ids=[])
    want = [ar.generate(PROMPT, 16, PARAMS, seed=s).tokens for s in range(12)]
    batcher = Batcher(runner, max_batch=5)
    got = batcher.run([BatchRequest(tree if s % 2 else ar, PROMPT, 16, PARAMS, seed=s) for s in range(12)])
    assert [r.tokens for r in got] == want


def test_batch_sampling_keeps_the_target_distribution():
    """Unseeded rejection sampling over random trees, eight requests per forward."""
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    runner = NativeRunner(model)
    engine = Engine(runner, RandomTreeDrafter(seed=7), eos_token_ids=[], verifier_cls=RejectionVerifier)
    torch.manual_seed(0)
    n = 6000
    batcher = Batcher(runner, max_batch=8)
    results = batcher.run([BatchRequest(engine, PROMPT, 2, PARAMS) for _ in range(n)])
    counts = Counter(tuple(r.tokens) for r in results)
    p = chi2_pvalue(counts, exact_joint(model), n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
