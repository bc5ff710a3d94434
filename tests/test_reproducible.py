"""The reproducible mode: steps padded to a fixed row count (``NativeRunner.with_fixed_rows``) and
chain drafts only (``Engine(chains_only=True)``). Greedy output stays plain decoding's (float32);
the bfloat16 repeat test runs on the server (tests/test_server_hardening.py).
"""

import random

import pytest
from conftest import TINY_VOCAB, OracleDrafter

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.engine import Engine
from speculum.runners import NativeRunner
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
