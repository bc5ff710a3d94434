"""The reproducible mode: row-invariant steps (``NativeRunner.invariant``: every matrix product over
at least its row floor, attention by its explicit path) or, where a machine's kernels give no
floor, steps padded to a fixed row count (``NativeRunner.with_fixed_rows``); chain drafts only
(``Engine(chains_only=True)``). Greedy output stays plain decoding's (float32); in bfloat16 a
token's logits are the same bits whatever step computed them. The server's repeat tests are in
tests/test_server_hardening.py.
"""

import dataclasses
import random

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_llama

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.engine import Engine
from speculum.runners import NativeRunner
from speculum.runners.invariance import KEY_FLOOR, RowFloors, measure_floors
from speculum.tree import DraftTree

NEW = 40


def test_best_chain_follows_the_largest_expected_gain():
    #        0 (a, .9) -- 1 (b, .2)
    # root <
    #        2 (c, .6) -- 3 (d, .5) -- 4 (e, .4)
    tree = DraftTree([10, 11, 12, 13, 14], [-1, 0, -1, 2, 3], scores=[0.9, 0.2, 0.6, 0.5, 0.4], tags=list("abcde"))
    best = tree.best_chain()
    assert best.tokens == [12, 13, 14] and best.is_chain and best.tags == list("cde")
    unscored = DraftTree([10, 11, 12, 13], [-1, -1, 0, 0])
    assert unscored.best_chain().tokens == [10, 12]  # first child at every level
    chain = DraftTree.chain([1, 2, 3])
    assert chain.best_chain() is chain and DraftTree().best_chain().tokens == []


@pytest.mark.parametrize("rows", [1, 8])
def test_fixed_rows_chains_are_lossless(tiny_model, rows):
    """Padded fixed-row steps with tree drafts cut to chains: plain decoding's tokens (float32)."""
    base = NativeRunner(tiny_model)
    fixed = base.with_fixed_rows(rows)
    assert fixed.decoder is base.decoder and fixed.graphs is not None and "rows=" in fixed.variant
    rng = random.Random(rows)
    ar = Engine(base, AutoregressiveDrafter(), eos_token_ids=[])
    for i in range(12):
        prompt = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))]
        want = ar.generate(prompt, NEW).tokens
        for drafter in (OracleDrafter(prompt + want, TINY_VOCAB, max_len=12, shape="tree", seed=i),
                        NgramDrafter()):
            engine = Engine(fixed, drafter, eos_token_ids=[], max_tree=rows - 1, chains_only=True)
            result = engine.generate(prompt, NEW)
            assert result.tokens == want, (i, drafter.name)
            if rows > 1 and drafter.name == "oracle":
                assert result.forwards < NEW  # drafts were accepted
                assert all(s.drafted <= rows - 1 for s in result.steps)


def test_fixed_rows_must_be_positive(tiny_model):
    with pytest.raises(ValueError, match="fixed_rows"):
        NativeRunner(tiny_model, fixed_rows=0)


def _chain_logits_match(runner, prompt: list[int], tokens: list[int], lengths: list[int]) -> list[int]:
    """Score ``prompt + tokens`` one token per step, then again in chain steps of the given
    ``lengths`` (cycled); returns the positions whose logits rows differ in any bit."""
    def score(step_lengths):
        cache = runner.new_cache(len(prompt) + len(tokens) + 70)
        runner.prefill(cache, prompt[:-1])
        seq, rows, i, k = prompt[-1:] + tokens, [], 0, 0
        while i < len(tokens):
            n = min(step_lengths[k % len(step_lengths)], len(tokens) - i)
            rows.extend(runner.forward(cache, seq[i], DraftTree.chain(seq[i + 1:i + n])).logits)
            runner.commit(cache, list(range(n)))
            i, k = i + n, k + 1
        return rows
    single, chained = score([1]), score(lengths)
    return [i for i, (a, b) in enumerate(zip(single, chained)) if not torch.equal(a, b)]


def test_invariant_rows_whatever_the_step_length():
    """bfloat16: each token's logits come out bit for bit the same in one-token steps and inside
    chains of 2..12 tokens, with the floors measured here and with floors that force padding (a
    product padded to 3 rows, whole steps to 2), also from a prompt shorter than the key floor."""
    model = tiny_llama(seed=3, layers=2).to(torch.bfloat16)
    runner = NativeRunner(model).invariant()
    if runner.floors is None:
        pytest.skip("this machine's bfloat16 kernels give no row floor (the mode pads every step instead)")
    assert runner.floors.up_to == 65 and "invariant" in runner.variant
    rng = random.Random(0)
    tokens = [rng.randrange(TINY_VOCAB) for _ in range(60)]
    for floors in (runner.floors, dataclasses.replace(runner.floors, down=3, head=2, step=2)):
        runner.floors = floors
        for prompt_len in (3, KEY_FLOOR + 5):
            prompt = [rng.randrange(TINY_VOCAB) for _ in range(prompt_len)]
            assert _chain_logits_match(runner, prompt, tokens, [2, 5, 12, 3, 7]) == []


@pytest.mark.parametrize("floors", [RowFloors(up_to=65), RowFloors(down=3, head=2, step=2, up_to=65)],
                         ids=["floors1", "padded"])
def test_invariant_mode_is_lossless(tiny_model, floors):
    """The invariant runner's steps (explicit attention, padding rows) with tree drafts cut to
    chains: plain decoding's tokens (float32)."""
    base = NativeRunner(tiny_model)
    inv = base.invariant(floors=floors)
    assert inv.floors == floors
    rng = random.Random(5)
    ar = Engine(base, AutoregressiveDrafter(), eos_token_ids=[])
    for i in range(8):
        prompt = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))]
        want = ar.generate(prompt, NEW).tokens
        for drafter in (OracleDrafter(prompt + want, TINY_VOCAB, max_len=12, shape="tree", seed=i), NgramDrafter(),
                        AutoregressiveDrafter()):
            result = Engine(inv, drafter, eos_token_ids=[], chains_only=True).generate(prompt, NEW)
            assert result.tokens == want, (i, drafter.name)


def test_no_floor_falls_back_to_padded_steps(monkeypatch):
    """Where some kernel has no row floor (float32 through MKL on a tiny model, at two threads, here),
    the mode pads every step to the fallback row count instead."""
    monkeypatch.setattr("speculum.runners.native.measure_floors", lambda decoder, max_rows: None)
    runner = NativeRunner(tiny_llama(seed=3)).invariant(fallback_rows=8)
    assert runner.floors is None and runner.fixed_rows == 8 and runner.graphs is not None


def test_measured_floors_hold_and_steps_past_them_are_refused():
    """The floors measured on a model hold for row counts the probe did not try, and a step longer
    than the probe's range is refused rather than run without the guarantee."""
    model = tiny_llama(seed=4).to(torch.bfloat16)
    runner = NativeRunner(model)
    floors = measure_floors(runner.decoder, max_rows=20)
    assert isinstance(floors, RowFloors) and floors.up_to == 20
    inv = runner.invariant(max_rows=20)
    linear = runner.decoder.layers[0].down
    x = torch.randn(37, linear.in_features).to(torch.bfloat16)
    full = linear(x[:19])
    for c in (floors.down, 17, 19):  # 17 and 19 are not among the probed counts
        assert torch.equal(linear(x[:c], floors.down), full[:c])
    cache = inv.new_cache(64)
    inv.prefill(cache, [1, 2, 3])
    with pytest.raises(RuntimeError, match="reproducible mode"):
        inv.forward(cache, 4, DraftTree.chain(list(range(20))))


@pytest.mark.slow
def test_smollm2_bfloat16_invariant_logits():
    """The real model in bfloat16 (oneDNN's kernels where the CPU has them): each token's logits are
    the same bits in one-token steps as inside chains, in the invariant runner."""
    import speculum

    model, tok = speculum.load("default", dtype="bfloat16", weights="float")
    runner = NativeRunner(model).invariant()
    prompt = tok("The lighthouse keeper climbed the stairs and", add_special_tokens=False).input_ids
    tokens = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[]).generate(prompt, 48).tokens
    assert _chain_logits_match(runner, prompt, tokens, [2, 7, 3, 12, 5, 16]) == []


def test_cheap_floors_are_at_most_one_padding_row():
    """The server turns the mode on by default only where its padding costs at most one row."""
    assert RowFloors(down=2, up_to=65).cheap and RowFloors(up_to=65).cheap
    assert not RowFloors(qkv=4, up_to=65).cheap and not RowFloors(step=3, up_to=65).cheap
