"""DEL (``del``: early exit, exit layer and chain length from tracked per-layer acceptance) and Clover
(``clover``: regressive heads with an attention decoder over the context): lossless greedy output
on tiny Llama and Gemma-3, DEL's choice on a constructed acceptance history, and Clover's
regressive connection."""

import random

import pytest
import torch
from conftest import TINY_VOCAB, tiny_gemma3, tiny_llama

from speculum.drafters import DRAFTERS
from speculum.drafters.del_exit import ExitRates, spaced_exits
from speculum.drafting.layer_cost import best_depth
from speculum.errors import SpeculumError
from speculum.methods import build_method


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def repetitive(seed: int) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(TINY_VOCAB) for _ in range(6)]
    return motif * 5


# ---- DEL


@pytest.mark.parametrize("make", [lambda: tiny_llama(layers=4), tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("options", [{}, {"top_k": 3, "max_nodes": 12}, {"allow_none": False}],
                         ids=["chain", "tree", "always"])
def test_del_greedy_equals_ar(make, options):
    model = make()
    ar = build_method("ar", model, None)
    method = build_method("del", model, None, sized=False, **options)
    drafted = 0
    for p in prompts(2) + [repetitive(3)]:
        r = method.run(p, 40)
        assert r.tokens == ar.run(p, 40).tokens
        drafted += sum(s.drafted for s in r.steps)
    if not options.get("allow_none", True):
        assert drafted > 0


def test_del_chooses_the_exit_and_length_of_most_tokens_per_layer():
    """The module docstring's example: rates 0.3 / 0.8 / 0.9 at layers 2 / 4 / 6 of 8, costs l / 8."""
    model = tiny_llama(layers=8)
    drafter = DRAFTERS["del"].factory(target=model, draft_head=None, exits=[2, 4, 6], decay=1.0)
    drafter.costs = {e: e / 8 for e in (2, 4, 6)}
    for layer, hits in ((2, 3), (4, 8), (6, 9)):
        drafter.rates.add(layer, [True] * hits + [False] * (10 - hits))
    assert drafter.rates.rate(4) == pytest.approx(0.8)
    assert drafter.choose() == (4, 2)
    assert best_depth(0.3, 0.25, range(9))[0] == 1 and best_depth(0.9, 0.75, range(9))[0] == 1
    # the context turns easy for layer 2: it becomes the exit, with a longer chain
    drafter.rates.add(2, [True] * 40)
    exit_layer, depth = drafter.choose()
    assert exit_layer == 2 and depth > 2
    # nothing worth drafting: no draft (allow_none), or the best exit's single token (the paper's always-draft)
    drafter.rates = ExitRates((2, 4, 6), 1.0)
    for layer in (2, 4, 6):
        drafter.rates.add(layer, [False] * 10)
    assert drafter.choose()[1] == 0
    drafter.allow_none = False
    assert drafter.choose()[1] == 1


def test_del_rates_decay_toward_the_recent_context():
    rates = ExitRates((3,), decay=0.5)
    rates.add(3, [False] * 10 + [True] * 3)
    assert rates.rate(3) > 0.8  # 3 recent hits outweigh 10 old misses
    assert spaced_exits(30, 6) == (3, 8, 13, 19, 24, 29) and spaced_exits(4, 6) == (1, 2, 3)


def test_del_shadow_tokens_count_what_an_exit_would_have_drafted():
    """After a request, the exits' rates are those of their shadow tokens; on a model whose last
    layer is made to pass its input through, the exit before it agrees with the target always."""
    model = tiny_llama(layers=3)
    with torch.no_grad():  # layer 2 adds nothing: exiting after layer 2 is the target
        layer = model.model.layers[2]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    method = build_method("del", model, None, sized=False, exits=[1, 2])
    ar = build_method("ar", model, None)
    p = prompts(7, 1)[0]
    r = method.run(p, 30)
    assert r.tokens == ar.run(p, 30).tokens
    drafter = method.engine.drafter
    assert drafter.rates.rate(2) == pytest.approx(1.0)
    assert drafter.choice[0] == 2 and drafter.choice[1] == drafter.max_depth  # certain: the longest chain
    assert sum(s.accepted for s in r.steps) == sum(s.drafted for s in r.steps) > 0


def test_del_refuses_bad_exits():
    model = tiny_llama(layers=4)
    with pytest.raises(SpeculumError, match="exits"):
        DRAFTERS["del"].factory(target=model, draft_head=None, exits=[4])
    with pytest.raises(SpeculumError, match="decay"):
        DRAFTERS["del"].factory(target=model, draft_head=None, decay=0.0)
