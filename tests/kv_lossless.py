"""Shared checks for KV policies: greedy output of every model-free drafter under a policy equals
``ar``'s under the same policy (and, with a covering budget, ``ar``'s without one).

Used by the policy tests (``tests/test_kv*.py``): one call per (model, policy).
"""

from __future__ import annotations

import random

from conftest import TINY_VOCAB, OracleDrafter

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.kv import make_policy
from speculum.methods import build_method
from speculum.runners import runner_for, under_policy

# drafters that need no head or draft model: prompt lookup, suffix trees, Token Recycling, their mix
DRAFTERS = ("ngram", "suffix", "recycling", "mix")


def lookup_prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` tokens that repeat a motif, so that prompt lookup and suffix trees find drafts."""
    rng = random.Random(seed)
    motif = [rng.randrange(TINY_VOCAB) for _ in range(9)]
    out = []
    while len(out) < n:
        out += motif if rng.random() < 0.6 else [rng.randrange(TINY_VOCAB) for _ in range(5)]
    return out[:n]


def outputs_under(model, spec: str, budget, prompt: list[int], new: int = 32) -> dict[str, list[int]]:
    """Greedy tokens of ``ar``, every model-free drafter and a random oracle tree, all under the
    policy ``spec`` with ``budget`` (a fresh policy object per method)."""
    out = {}
    for name in ("ar",) + DRAFTERS:
        method = build_method(name, model, None, kv_policy=make_policy(spec, budget), sized=False)
        out[name] = method.run(prompt, new).tokens
    engine = Engine(under_policy(runner_for(model, "native"), make_policy(spec, budget)),
                    OracleDrafter(prompt + out["ar"], TINY_VOCAB, shape="tree", seed=7), eos_token_ids=[])
    out["oracle_tree"] = engine.generate(prompt, new).tokens
    return out


def assert_drafters_equal_ar(model, spec: str, budget, prompt: list[int], new: int = 32,
                             plain: list[int] | None = None) -> None:
    """Every drafter's output under ``spec`` equals ``ar``'s under it; ``plain``: ``ar``'s output
    without a policy, which a covering budget must also reproduce."""
    out = outputs_under(model, spec, budget, prompt, new)
    for name, tokens in out.items():
        assert tokens == out["ar"], f"{name} under {spec} (budget {budget})"
    if plain is not None:
        assert out["ar"] == plain, f"ar under {spec} (budget {budget}) against no policy"


def ar_tokens(model, prompt: list[int], new: int = 32) -> list[int]:
    """Greedy tokens without a policy."""
    return Engine(runner_for(model, "native"), AutoregressiveDrafter(), eos_token_ids=[]).generate(prompt, new).tokens
