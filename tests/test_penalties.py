"""Repetition, frequency and presence penalties: plain decoding follows the formula (checked against
a full recomputation), and every drafter, tree shape, batch and seeded sample gives plain decoding's
output with them (float32, tiny models)."""

import random

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_gemma3, tiny_llama
from test_sampling import RandomTreeDrafter

from speculum.batching import Batcher, BatchRequest
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.penalties import Penalties
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree

PENALTIES = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.8),
             SamplingParams(presence_penalty=1.5),
             SamplingParams(repetition_penalty=0.9, frequency_penalty=-0.4, presence_penalty=0.6)]
IDS = ["repetition", "frequency", "presence", "all"]
NEW = 40


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(2, 20))] for _ in range(n)]


def reference(model, prompt: list[int], params: SamplingParams, new: int) -> list[int]:
    """Greedy decoding with the penalties applied to full-recomputation logits, by the formula."""
    ids, out = list(prompt), []
    for _ in range(new):
        with torch.no_grad():
            x = model(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(ids)] = True
        x = torch.where(seen, torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        out.append(int(x.argmax()))
        ids.append(out[-1])
    return out


def test_rows_follow_their_own_path():
    """The module docstring's example: output [7, 7], tree 5 -> 7, frequency 0.5."""
    pen = Penalties(SamplingParams(frequency_penalty=0.5), [1], 10, torch.device("cpu"))
    pen.commit([7, 7])
    got = pen.apply(DraftTree([5, 7], [-1, 0]), torch.zeros(3, 10))
    want = torch.zeros(3, 10)
    want[0, 7], want[1, 7], want[1, 5], want[2, 7], want[2, 5] = -1.0, -1.0, -0.5, -1.5, -0.5
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("params", PENALTIES, ids=IDS)
def test_plain_decoding_applies_the_formula(make, params):
    model = make()
    ar = build_method("ar", model, None)
    changed = False
    for p in prompts(1):
        out = ar.run(p, NEW, params).tokens
        assert out == reference(model, p, params, NEW)
        changed |= out != ar.run(p, NEW).tokens
    assert changed, "the penalty changed no output: the test would not see it ignored"


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("params", PENALTIES, ids=IDS)
def test_every_drafter_and_tree_equals_plain_decoding(make, params):
    """Oracle chains and trees (mostly right, so whole paths get accepted past repeated tokens), random
    trees and speculum's model-free drafters."""
    model = make()
    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    for i, p in enumerate(prompts(2)):
        want = ar.generate(p, NEW, params).tokens
        drafters = [OracleDrafter(p + want, TINY_VOCAB, shape=shape, seed=i) for shape in ("chain", "tree")]
        drafters.append(RandomTreeDrafter(seed=i))
        for d in drafters:
            assert Engine(runner, d, eos_token_ids=[]).generate(p, NEW, params).tokens == want, d.name
    for name in ("ngram", "ngram_tree", "suffix", "recycling", "mix", "auto"):
        method = build_method(name, model, None, runner=runner, sized=False)
        for p in prompts(3):
            assert method.run(p, NEW, params).tokens == build_method("ar", model, None).run(p, NEW, params).tokens, name


def test_batched_and_seeded_sampling_equal_solo_plain_decoding():
    """In one batch, requests with and without penalties, greedy and seeded samples, each equal to its
    solo plain decoding (keyed sampling: a seeded request's output does not depend on the drafter)."""
    model = tiny_llama(seed=3, logit_scale=4.0)
    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    tree = Engine(runner, RandomTreeDrafter(seed=5), eos_token_ids=[])
    sampled = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.7, repetition_penalty=1.2)
    cases = [(p, params, seed) for p in prompts(4, n=2)
             for params, seed in [(PENALTIES[3], None), (SamplingParams(), None), (sampled, 11), (sampled, 12)]]
    want = [ar.generate(p, NEW, params, seed=seed).tokens for p, params, seed in cases]
    assert [tree.generate(p, NEW, params, seed=seed).tokens for p, params, seed in cases] == want
    got = Batcher(runner, max_batch=5).run([BatchRequest(tree, p, NEW, params, seed=seed) for p, params, seed in cases])
    assert [r.tokens for r in got] == want


def test_bad_penalties_are_refused():
    for kw in ({"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")}, {"frequency_penalty": 2.5},
               {"presence_penalty": -2.1}, {"presence_penalty": float("nan")}):
        with pytest.raises(SpeculumError):
            SamplingParams(**kw)
    model = tiny_llama()
    with pytest.raises(SpeculumError, match="frequency or presence"):
        build_method("hf", model, None).run([1, 2, 3], 4, SamplingParams(frequency_penalty=0.5))
