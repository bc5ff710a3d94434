"""Stop conditions: EOS and stop strings inside accepted drafts end generation exactly there."""

import pytest
from conftest import TINY_VOCAB, CharTokenizer, OracleDrafter

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.runners import HFRunner

PROMPT = [3, 1, 4, 1, 5]


def _ref(model, n=30):
    return Engine(HFRunner(model), AutoregressiveDrafter(), eos_token_ids=[]).generate(PROMPT, n).tokens


def test_eos_inside_draft_ends_exactly_there(tiny_model):
    ref = _ref(tiny_model)
    eos = ref[6]
    cut = ref.index(eos) + 1
    runner = HFRunner(tiny_model)
    for eng in (Engine(runner, AutoregressiveDrafter(), eos_token_ids=[eos]),
                Engine(runner, OracleDrafter(PROMPT + ref, TINY_VOCAB, max_len=16, seed=1), eos_token_ids=[eos])):
        out = eng.generate(PROMPT, 30)
        assert out.tokens == ref[:cut] and out.finish_reason == "eos"


def test_stop_string_inside_draft(tiny_model):
    ref = _ref(tiny_model)
    tok = CharTokenizer()
    text = tok.decode(ref)
    stop = text[8:11]
    first = text.find(stop)
    runner = HFRunner(tiny_model)
    outs = []
    for drafter in (AutoregressiveDrafter(), OracleDrafter(PROMPT + ref, TINY_VOCAB, max_len=16, seed=2)):
        out = Engine(runner, drafter, tok, eos_token_ids=[]).generate(PROMPT, 30, stop=[stop])
        assert out.finish_reason == "stop"
        assert out.text == text[:first]
        assert len(out.tokens) == first + len(stop)  # one char per token: ends on the stop's last token
        outs.append(out.tokens)
    assert outs[0] == outs[1]


def test_max_new_tokens_truncates_accepted_draft(tiny_model):
    ref = _ref(tiny_model)
    runner = HFRunner(tiny_model)
    for n in (1, 2, 7):
        out = Engine(runner, OracleDrafter(PROMPT + ref, TINY_VOCAB, seed=n), eos_token_ids=[]).generate(PROMPT, n)
        assert out.tokens == ref[:n] and out.finish_reason == "length"


def test_streaming_chunks_concatenate_to_result(tiny_model):
    ref = _ref(tiny_model)
    eng = Engine(HFRunner(tiny_model), OracleDrafter(PROMPT + ref, TINY_VOCAB, seed=3), eos_token_ids=[])
    chunks = []
    out = eng.generate(PROMPT, 30, on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == out.tokens == ref
    assert len(chunks) == out.forwards


def test_engine_input_errors(tiny_model):
    eng = Engine(HFRunner(tiny_model), AutoregressiveDrafter(), eos_token_ids=[])
    with pytest.raises(SpeculumError, match="empty"):
        eng.generate([], 5)
    with pytest.raises(SpeculumError, match="max_new_tokens"):
        eng.generate(PROMPT, 0)
    with pytest.raises(SpeculumError, match="context"):
        eng.generate([1] * 300, 5)  # tiny models have 256 positions
    with pytest.raises(SpeculumError, match="token ids"):
        eng.generate([TINY_VOCAB + 5], 5)


def test_context_limit_stops_generation(tiny_model):
    out = Engine(HFRunner(tiny_model), AutoregressiveDrafter(), eos_token_ids=[]).generate([1] * 250, 20)
    assert out.finish_reason == "context" and len(out.tokens) == 6
