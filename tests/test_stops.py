"""Stop conditions: EOS and stop strings inside accepted drafts end generation exactly there."""

import pytest
from conftest import TINY_VOCAB, CharTokenizer, OracleDrafter

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.runners import HFRunner
from speculum.stops import Stops

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


def _full_decode_stop(stops: Stops, generated: list[int], new_from: int):
    """The reference rule: the shortest prefix ending in the new tokens whose full text holds a stop."""
    if not any(s in stops.text(generated) for s in stops.stop):
        return None
    for k in range(max(new_from, 1), len(generated) + 1):
        if any(s in stops.text(generated[:k]) for s in stops.stop):
            return k, "stop"
    return None


def test_tail_decoding_finds_the_stops_full_decoding_finds():
    """Stop strings are searched in a decoded tail (O(1) a step, not O(n)); on SmolLM2's tokenizer,
    random multi-byte and whitespace-heavy outputs cut into random steps, it agrees with decoding
    everything at every step."""
    import random

    from speculum.models import load_tokenizer_and_config

    tok, _ = load_tokenizer_and_config("default")
    rng = random.Random(0)
    pieces = ["Hello", " world", "\n\n", "  ", "é", "日本語", "🙂", "###", " the end", "STOP", "\t", "a b c"]
    checked = hits = 0
    for trial in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(5, 60)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if rng.random() < 0.3:  # byte-level pieces out of order: partial UTF-8 characters
            ids = ids[:] + [rng.randrange(256) for _ in range(5)]
        decoded = tok.decode(ids, skip_special_tokens=True)
        stop = decoded[rng.randrange(len(decoded)):][: rng.randint(1, 12)] if rng.random() < 0.8 else "absent!"
        stops = Stops(tok, set(), [stop], 10_000, 100_000)
        pos = 0
        while pos < len(ids):
            step = rng.randint(1, 8)
            want = _full_decode_stop(stops, ids[:pos + step], pos)
            assert stops._stop_in(ids[:pos + step], pos) == want, (trial, pos, stop)
            checked += 1
            if want is not None:
                hits += 1
                break
            pos += step
    assert hits >= 30 and checked > 300
