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
from speculum.runners import HFRunner
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


def test_self_draft_accepts_everything():
    model = tiny_llama()
    runner = HFRunner(model)
    out = Engine(runner, DraftModelDrafter(model, num_draft=4, adaptive=False), eos_token_ids=[]).generate(
        [1, 2, 3], 30)
    assert out.mean_accepted > 4.5  # 4 drafted + 1 bonus per step, except where max_new_tokens cuts


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
