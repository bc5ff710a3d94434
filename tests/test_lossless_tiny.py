"""Greedy losslessness on tiny random models: every drafter and tree shape reproduces plain decoding.

Hundreds of random prompts, draft lengths 1..16, chains and random trees, on a Llama-shaped and a
Gemma-3-shaped model (sliding window 8, far shorter than the sequences). A deliberately wrong
verifier must fail the same check.
"""

import random

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_llama

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.draft_model import DraftModelDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.engine import Engine
from speculum.runners import HFRunner, NativeRunner
from speculum.tree import DraftTree
from speculum.tree_sizing import CostModel, TreeSizer
from speculum.verify import Acceptance, Verifier

NEW = 40


def _prompts(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 12))]
        # repeated material so that prompt lookup finds matches
        out.append((base * rng.randint(1, 4))[: rng.randint(1, 48)] or base[:1])
    return out


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_ar_matches_transformers_generate(tiny_model):
    runner = HFRunner(tiny_model)
    engine = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    for prompt in _prompts(10, 1):
        assert engine.generate(prompt, NEW).tokens == _hf_greedy(tiny_model, prompt, NEW)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_oracle_drafts_are_lossless(tiny_model, shape):
    runner = HFRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    for i, prompt in enumerate(_prompts(120, 2)):
        ref = ar.generate(prompt, NEW).tokens
        drafter = OracleDrafter(prompt + ref, TINY_VOCAB, max_len=16, shape=shape, seed=i)
        out = Engine(runner, drafter, eos_token_ids=[]).generate(prompt, NEW)
        assert out.tokens == ref, f"prompt {i}"
        assert out.forwards <= len(ref)


@pytest.mark.parametrize("opts", [
    {}, {"adaptive": False, "max_draft": 16, "unigram_draft": 16}, {"max_ngram": 6, "prefer": "first"},
    {"max_draft": 1, "min_draft": 1},
])
def test_ngram_lossless(tiny_model, opts):
    runner = HFRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    ng = Engine(runner, NgramDrafter(**opts), eos_token_ids=[])
    drafted = 0
    for prompt in _prompts(60, 3):
        out = ng.generate(prompt, NEW)
        assert out.tokens == ar.generate(prompt, NEW).tokens
        drafted += sum(s.drafted for s in out.steps)
    assert drafted > 0


@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_draft_model_lossless(tiny_model, num_draft):
    runner = HFRunner(tiny_model)
    cfg = tiny_model.config
    draft = tiny_llama(seed=7, vocab=cfg.vocab_size, layers=1)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    dm = Engine(runner, DraftModelDrafter(draft, num_draft=num_draft), eos_token_ids=[])
    for prompt in _prompts(25, 4):
        assert dm.generate(prompt, NEW).tokens == ar.generate(prompt, NEW).tokens


@pytest.mark.parametrize("options,sized", [({"top_k": 2, "num_draft": 3}, False),
                                           ({"top_k": 4, "num_draft": 6, "max_nodes": 12}, True),
                                           ({"stop_risk": 0.5, "num_draft": 6}, False)],
                         ids=["tree2", "tree4_sized", "stop_risk"])
def test_draft_model_trees_and_adaptive_stop_lossless(tiny_model, options, sized):
    """Draft-model trees (EAGLE-2's dynamic tree from the draft's logits) and SpecDec++'s stop,
    as drafted and sized to a cost curve, equal plain decoding; the tree's nodes get accepted."""
    runner = NativeRunner(tiny_model)
    draft = tiny_llama(seed=7, vocab=tiny_model.config.vocab_size, layers=1)
    sizer = TreeSizer(CostModel([1, 16, 64], [64], [[0.01, 0.012, 0.03]])) if sized else None
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    dm = Engine(runner, DraftModelDrafter(draft, **options), eos_token_ids=[], sizer=sizer)
    drafted = accepted = 0
    for prompt in _prompts(26, 4):
        out = dm.generate(prompt, NEW)
        assert out.tokens == ar.generate(prompt, NEW).tokens
        drafted += sum(s.drafted for s in out.steps)
        accepted += sum(s.accepted for s in out.steps)
    assert drafted > 0 and (accepted > 0 or "stop_risk" in options)  # (a stop may rightly leave one token)


def test_draft_model_tree_from_the_target_itself_is_mostly_accepted():
    """With the target as its own draft, the tree holds the target's greedy path (a peaked model:
    where probabilities are flat, another parent's best child may outscore the greedy path's)."""
    model = tiny_llama(logit_scale=30.0)
    drafter = DraftModelDrafter(model, num_draft=4, top_k=3, max_nodes=64, min_path_prob=0.0)
    out = Engine(NativeRunner(model), drafter, eos_token_ids=[]).generate([1, 2, 3], 30)
    assert [s.accepted for s in out.steps[:5]] == [4] * 5  # 4 depths; the last steps run out of room


def test_draft_model_stop_risk_shortens_chains_where_drafts_fail():
    """A draft that disagrees with the target: SpecDec++'s stop learns to draft short chains."""
    model = tiny_llama()
    draft = tiny_llama(seed=9, layers=1)
    fixed = Engine(NativeRunner(model), DraftModelDrafter(draft, num_draft=6, adaptive=False), eos_token_ids=[])
    stopped = Engine(NativeRunner(model), DraftModelDrafter(draft, num_draft=6, stop_risk=0.5), eos_token_ids=[])
    for e in (fixed, stopped):
        e.generate([1, 2, 3], 40)  # the stop's calibration learns from a first request
    drafted = [sum(s.drafted for s in e.generate([4, 5, 6], 40).steps) / 40 for e in (fixed, stopped)]
    assert drafted[1] < drafted[0] / 2


def test_self_draft_accepts_everything():
    model = tiny_llama()
    runner = HFRunner(model)
    out = Engine(runner, DraftModelDrafter(model, num_draft=4, adaptive=False), eos_token_ids=[]).generate(
        [1, 2, 3], 30)
    assert out.mean_accepted > 4.5  # 4 drafted + 1 bonus per step, except where max_new_tokens cuts


def _first_new_token_at(ref: list[int], start: int) -> int:
    """The first index from ``start`` whose token did not occur before it in ``ref``."""
    return next(i for i in range(start, len(ref)) if ref[i] not in ref[:i])


def test_nothing_is_drafted_or_verified_past_an_end_token():
    """A request's EOS ends it: the engine cuts drafted nodes below an EOS node before verifying, and
    a drafter that pays a forward per depth stops drafting at one; the output is ``ar``'s."""
    model = tiny_llama()
    runner = NativeRunner(model)
    prompt = [1, 2, 3]
    ref = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[]).generate(prompt, 30).tokens
    end = _first_new_token_at(ref, 4)
    want = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[ref[end]]).generate(prompt, 30).tokens
    assert want == ref[:end + 1]

    class Truth(OracleDrafter):  # the true continuation, 8 tokens, past the end token too
        def propose(self, tokens, budget):
            return DraftTree.chain(self.reference[len(tokens):len(tokens) + min(8, budget)])

    out = Engine(runner, Truth(prompt + ref, TINY_VOCAB), eos_token_ids=[ref[end]]).generate(prompt, 30)
    assert out.tokens == want
    assert all(s.drafted <= s.committed for s in out.steps)  # nothing verified past the end

    drafter = DraftModelDrafter(model, num_draft=8, adaptive=False)  # the target drafting for itself
    forwards = []
    inner = drafter.runner.forward_tree
    drafter.runner.forward_tree = lambda *a, **k: forwards.append(1) or inner(*a, **k)
    out = Engine(runner, drafter, eos_token_ids=[ref[end]]).generate(prompt, 30)
    assert out.tokens == want
    assert len(forwards) == sum(s.drafted for s in out.steps) <= len(want)  # one forward per drafted token, none past


class OffByOneVerifier(Verifier):
    """Wrong on purpose: also accepts the first mismatching drafted token."""

    def accept_greedy(self, tree, logits):
        acc = super().accept_greedy(tree, logits)
        kids = tree.children()
        last = acc.path[-1] + 1 if acc.path else 0
        if kids[last]:
            wrong = kids[last][0]
            return Acceptance(acc.path + [wrong], [tree.tokens[i] for i in acc.path + [wrong]]
                              + [int(logits[wrong + 1].argmax())])
        return acc


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_wrong_verifier_is_caught(tiny_model, shape):
    runner = HFRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    mismatches = 0
    for i, prompt in enumerate(_prompts(20, 5)):
        ref = ar.generate(prompt, NEW).tokens
        drafter = OracleDrafter(prompt + ref, TINY_VOCAB, shape=shape, seed=i)
        out = Engine(runner, drafter, eos_token_ids=[], verifier_cls=OffByOneVerifier).generate(prompt, NEW)
        mismatches += out.tokens != ref
    assert mismatches >= 10
