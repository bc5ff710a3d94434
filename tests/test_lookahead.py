"""``lookahead`` (Lookahead decoding): lossless greedy output for its window shapes, pools and trees
on tiny Llama and Gemma-3 past its window, alone and batched; seeded sampling equal to ``ar``'s;
the window's mask and Jacobi pool; the window switch; clear refusals."""

import random

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, batched_join_midway, tiny_gemma3, tiny_llama
from test_tree_drafters import FakeClock

from speculum.drafters import DRAFTERS
from speculum.drafters.lookahead import LookaheadDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree, PromptRows
from speculum.tree_sizing import CostModel, TreeSizer

# the window always on (adaptive=False) unless a case says otherwise: its rows must run to be tested
SHAPES = {
    "default": {"adaptive": False},
    "small_window": {"adaptive": False, "window": 2, "ngram": 3, "guesses": 2},
    "deep": {"adaptive": False, "window": 4, "ngram": 6},
    "jacobi_only": {"adaptive": False, "from_text": False},
    "adaptive": {},
    "sized": {"adaptive": False, "sized": True},
}


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):  # some repetition, so that the text pool has something to offer
        base = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 12))]
        out.append((base * 3)[:rng.randint(1, 30)])
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_greedy_lookahead_equals_ar(make, shape):
    model = make()
    options = dict(SHAPES[shape])
    sized = options.pop("sized", False)
    cost = CostModel([1, 16, 64], [64], [[0.01, 0.012, 0.03]]) if sized else None
    ar = build_method("ar", model, None)
    method = build_method("lookahead", model, None, sized=sized, cost_model=cost, **options)
    drafted = accepted = 0
    for p in prompts(1):
        out = method.run(p, 48)
        assert out.tokens == ar.run(p, 48).tokens
        drafted += sum(s.drafted for s in out.steps)
        accepted += sum(s.accepted for s in out.steps)
    assert drafted > 0 and accepted > 0


def test_jacobi_window_alone_drafts_accepted_ngrams():
    """Without text n-grams the pool holds only what the window's Jacobi iterates wrote: some of it
    is accepted (the target's own future tokens), and its n-grams have the configured length."""
    model = tiny_llama(layers=2, logit_scale=4.0)
    method = build_method("lookahead", model, None, from_text=False, adaptive=False, ngram=4, sized=False)
    accepted = 0
    for p in prompts(2):
        accepted += sum(s.accepted for s in method.run(p, 48).steps)
    pool = method.engine.drafter.pool
    assert accepted > 0 and pool
    assert all(len(gram) == 3 for grams in pool.values() for gram in grams)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_batched_lookahead_equals_solo(make):
    """In a batch the runner leaves the window's rows out (the pool drafts from text alone): every
    request still equals its solo ``ar`` output, requests joining mid-way."""
    model = make()
    runner = NativeRunner(model)
    drafter = DRAFTERS["lookahead"].factory(target=model, draft_head=None, adaptive=False)
    engine = Engine(runner, drafter, eos_token_ids=[])
    ar = build_method("ar", model, None, runner=runner)
    ps = prompts(3, n=5)
    assert batched_join_midway(runner, engine, ps) == [ar.run(p, 40).tokens for p in ps]


def test_seeded_sampling_equals_ar():
    """Lookahead drafts point masses; with keyed sampling a seeded request samples the same text as
    ``ar`` with that seed, whatever was drafted and accepted."""
    model = tiny_llama(seed=2, logit_scale=4.0)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    ar = build_method("ar", model, None)
    method = build_method("lookahead", model, None, adaptive=False, sized=False)
    accepted = 0
    for i, p in enumerate(prompts(4)):
        out = method.run(p, 40, params, seed=i)
        assert out.tokens == ar.run(p, 40, params, seed=i).tokens
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0


def test_window_rows_form_jacobi_chains():
    """Every window row sees the root and a run of rows at consecutive positions ending just
    before its own: one causal chain per row, as in the paper's 2D window."""
    model = tiny_llama()
    d = LookaheadDrafter(model, window=4, ngram=4, adaptive=False)
    d.reset([1, 2, 3, 4, 5], SamplingParams(), None)
    d.levels += [[6, 7, 8, 9], [10, 11, 12, 13]]  # a full window: level 0 (3), levels 1 and 2 (4 each)
    rows = d._window_rows()
    assert len(rows) == 3 + 4 + 4 and all(a == -1 for a in rows.anchors)
    for r, offset in enumerate(rows.offsets):
        seen = sorted(rows.offsets[c] for c in np.flatnonzero(rows.among[r]))
        assert seen == list(range(1, offset + 1)), (r, offset, seen)  # positions 1..offset; 0 is the root


def test_full_window_shifts_and_fills_the_pool():
    model = tiny_llama()
    d = LookaheadDrafter(model, window=3, ngram=3, adaptive=False, from_text=False)
    d.reset([1, 2, 3], SamplingParams(), None)
    d.levels = [[4, 5], [6, 7, 8]]
    tree = d.propose([1, 2, 3], 8)
    assert len(tree) == 0 and len(tree.prompts) == 2 + 3
    logits = torch.zeros(5, TINY_VOCAB)
    logits[torch.arange(5), torch.tensor([0, 0, 20, 21, 22])] = 1.0  # the top level's outputs: 20, 21, 22
    d.see_prompt_logits(tree, None, logits)
    assert d.levels == [[7, 8], [20, 21, 22]]
    # each column spells an n-gram keyed by block 0's token (root 3, then level 0's 4 and 5)
    assert {k: list(v) for k, v in d.pool.items()} == {3: [(6, 20)], 4: [(7, 21)], 5: [(8, 22)]}
    assert d.propose([1, 2, 3], 8).tokens == [6, 20]


def test_window_switch_turns_off_a_window_that_does_not_pay():
    """Simulated: the window's rows add 10 ms a step and never a token; the switch learns to leave them out."""
    clock = FakeClock()
    d = LookaheadDrafter(tiny_llama(), clock=clock, from_text=False)  # nothing to draft: the rows are pure cost
    tokens = [1, 2, 3]
    d.reset(tokens, SamplingParams(), None)
    for _ in range(300):
        tree = d.propose(tokens, 8)
        clock.t += 0.030 if tree.prompts is not None else 0.020
        tokens = tokens + [4]
        d.update(tokens, tree, None, None)  # (an empty tree: nothing to learn from the target)
    assert sum(d.with_window[-100:]) <= 20


def test_sizer_counts_the_rows_after_the_root():
    """Rows hung after the root cost whatever nodes are kept: where they push the forward past the
    flat part of the cost curve, fewer nodes pay."""
    cost = CostModel([1, 8, 16, 32], [64], [[0.010, 0.0105, 0.020, 0.040]])  # flat to 8 rows, then ~1.2 ms a row
    tree = DraftTree.chain([5] * 6)
    tree.scores = [0.9, 0.6, 0.4, 0.3, 0.2, 0.1]
    plain = len(TreeSizer(cost).select(tree, 64))
    assert plain == 6
    tree.prompts = PromptRows([-1] * 12, list(range(1, 13)), torch.zeros(12, 4), np.eye(12, dtype=bool))
    assert len(TreeSizer(cost).select(tree, 64)) < plain


def test_sizer_keeps_parents_of_kept_nodes():
    """A child whose score rounds above its parent's is kept only with the parent."""
    cost = CostModel([1, 4, 8], [64], [[0.010, 0.0101, 0.040]])  # 3 nodes + the root: flat; 5 rows: dear
    tree = DraftTree.chain([5] * 5)
    tree.scores = [0.9166666666666666, 0.9166666666666665, 0.8333333333333331, 0.8333333333333333, 0.75]
    kept = TreeSizer(cost).select(tree, 64)
    assert 0 < len(kept) < 5 and kept.parents == list(range(-1, len(kept) - 1))


def test_lookahead_refuses_bad_options():
    model = tiny_llama()
    for bad in ({"window": 1}, {"ngram": 2}, {"guesses": 0}):
        with pytest.raises(SpeculumError, match="lookahead needs"):
            build_method("lookahead", model, None, **bad)
