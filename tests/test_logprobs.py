"""Logprobs: each emitted token's log-probability and its top alternatives come from the verification
forward that accepted it, and equal what one forward of the whole sequence gives at that position,
whatever the drafter or tree (float32, tiny models); the processed mode reports the distribution the
token was drawn from."""

import math

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_gemma3, tiny_llama

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams

PROMPT = [5, 17, 3, 9, 5, 17, 3, 9, 40, 2, 5, 17]
NEW = 24


def _reference(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """``[len(tokens) - prompt_len, V]`` log-probabilities of each generated position, from one
    transformers forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[prompt_len - 1:len(tokens) - 1], dim=-1)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("drafter", ["ar", "ngram", "oracle_tree"])
def test_logprobs_equal_one_forward_of_the_sequence(make, drafter):
    model = make()
    want = Engine(NativeRunner(model), AutoregressiveDrafter(), eos_token_ids=[]).generate(PROMPT, NEW).tokens
    drafters = {"ar": AutoregressiveDrafter(), "ngram": NgramDrafter(),
                "oracle_tree": OracleDrafter(PROMPT + want, TINY_VOCAB, shape="tree")}
    out = Engine(NativeRunner(model), drafters[drafter], eos_token_ids=[]).generate(
        PROMPT, NEW, SamplingParams(logprobs=3))
    assert out.tokens == want and len(out.logprobs) == NEW
    ref = _reference(model, PROMPT + want, len(PROMPT))
    for j, t in enumerate(out.logprobs):
        assert t.token == want[j]
        assert math.isclose(t.logprob, float(ref[j, want[j]]), abs_tol=1e-4)
        top = ref[j].topk(3)
        assert [i for i, _ in t.top] == top.indices.tolist()
        assert all(math.isclose(lp, float(r), abs_tol=1e-4) for (_, lp), r in zip(t.top, top.values))


def test_processed_logprobs_are_the_sampled_distribution():
    """Sampling with top-k 2: the processed alternatives beyond the two kept are impossible, the
    emitted token's processed log-probability is finite and at least its raw one."""
    model = tiny_llama(logit_scale=4.0)
    engine = Engine(NativeRunner(model), NgramDrafter(), eos_token_ids=[])
    sampling = {"temperature": 1.0, "top_k": 2, "logprobs": 4}
    processed = engine.generate(PROMPT, NEW, SamplingParams(**sampling, logprobs_mode="processed"), seed=3)
    raw = engine.generate(PROMPT, NEW, SamplingParams(**sampling), seed=3)
    assert processed.tokens == raw.tokens  # the mode changes what is reported, not what is drawn
    for p, r in zip(processed.logprobs, raw.logprobs):
        assert math.isfinite(p.logprob) and p.logprob >= r.logprob - 1e-5
        assert all(lp == float("-inf") for _, lp in p.top[2:]) and all(math.isfinite(lp) for _, lp in p.top[:2])
        assert math.isclose(sum(math.exp(lp) for _, lp in p.top), 1.0, abs_tol=1e-4)


def test_logprobs_settings_are_checked():
    for bad in [{"logprobs": 21}, {"logprobs": -1}, {"logprobs": True}, {"logprobs_mode": "logits"}]:
        with pytest.raises(SpeculumError):
            SamplingParams(**bad)
