"""Exact constrained sampling: ASAp and AWRS against the distribution over whole outputs.

The grammar ``(a|b)c?d?`` over an 8-token vocabulary has few complete outputs (ten token sequences
of at most three tokens, counting ``c d`` and ``cd`` apart), so ``p(y | y in grammar)`` is computed by
enumeration. Plain masking is far from it (total variation about 0.5 on this model); ASAp after
warm-up and AWRS's weighted particles match it.
"""

import math
from collections import Counter

import pytest
import test_constrain as tc  # the module, so that its tests are not collected again here
import torch
from conftest import tiny_gemma3, tiny_llama
from scipy.stats import chisquare

from speculum.constrain import ConstraintSpec, Grammar
from speculum.constrain.asap import AsapTrie
from speculum.constrain.awrs import awrs_sample, generate_particles, resample
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.runners import HFRunner
from speculum.sampling import SamplingParams

SPEC = ConstraintSpec.regex("(a|b)c?d?")
PROMPT = [1, 5, 2]
PARAMS = SamplingParams(temperature=1.0)
NEW = 4  # three tokens and the end


def legal_outputs(grammar: Grammar, max_len: int = 3) -> list[tuple[int, ...]]:
    """Every complete output (end token included) of at most ``max_len`` tokens before the end."""
    out = []

    def walk(prefix: list[int]) -> None:
        m = grammar.matcher().m
        for t in prefix:
            assert m.consume_token(t)
        if m.is_accepting():
            out.append(tuple(prefix) + (0,))
        if len(prefix) < max_len:
            for t in range(1, 8):
                if m.validate_tokens([t]) == 1:
                    walk(prefix + [t])

    walk([])
    return out


def exact_distribution(model, grammar: Grammar) -> dict[tuple[int, ...], float]:
    """``p(y | y in grammar)`` by enumeration (``p``: PARAMS on the raw logits)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def p(prefix):
        if prefix not in cache:
            with torch.no_grad():
                cache[prefix] = PARAMS.probs(model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1])
        return cache[prefix]

    joint = {y: math.prod(float(p(y[:i])[y[i]]) for i in range(len(y))) for y in legal_outputs(grammar)}
    z = sum(joint.values())
    return {y: v / z for y, v in joint.items()}


def total_variation(estimate: dict, exact: dict) -> float:
    keys = set(estimate) | set(exact)
    return 0.5 * sum(abs(estimate.get(k, 0.0) - exact.get(k, 0.0)) for k in keys)


def chi_square_p(counts: Counter, exact: dict) -> float:
    n = sum(counts.values())
    assert all(k in exact for k in counts), "an output the grammar does not accept"
    keys = [k for k, p in exact.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)]
    expected = [exact[k] * n for k in keys] + [n * (1 - sum(exact[k] for k in keys))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def setup():
    tok = tc.char_tokenizer()
    model = tiny_llama(seed=0, vocab=8, layers=1, logit_scale=4.0)
    exact = exact_distribution(model, Grammar(SPEC, tok, 8, [0]))
    return tok, model, exact


def engine_for(setup, drafter=None) -> Engine:
    tok, model, _ = setup
    return Engine(HFRunner(model), drafter or AutoregressiveDrafter(), tok, eos_token_ids=[0])


def samples(engine: Engine, grammar: Grammar, n: int, first_seed: int = 0) -> Counter:
    return Counter(tuple(engine.generate(PROMPT, NEW, PARAMS, seed=s, grammar=grammar).tokens)
                   for s in range(first_seed, first_seed + n))


def test_masking_is_not_exact(setup):
    """The control: plain masking's outputs fail the test the exact methods pass."""
    tok, _, exact = setup
    counts = samples(engine_for(setup), Grammar(SPEC, tok, 8, [0]), 300)
    assert total_variation({k: v / 300 for k, v in counts.items()}, exact) > 0.3
    assert chi_square_p(counts, exact) < 1e-6


@pytest.mark.parametrize("drafter", ["ar", "tree"])
def test_asap_converges_to_the_exact_distribution(setup, drafter):
    tok, _, exact = setup
    grammar = Grammar(SPEC, tok, 8, [0], sampling="asap")  # a fresh grammar: a fresh trie
    engine = engine_for(setup, AutoregressiveDrafter() if drafter == "ar" else tc.RandomDrafts(True, seed=1))
    first = samples(engine, grammar, 1)  # the first sample is plain masking's; the trie learns from it
    assert sum(first.values()) == 1
    samples(engine, grammar, 60, first_seed=10_000)  # warm-up
    counts = samples(engine, grammar, 500, first_seed=20_000)
    p = chi_square_p(counts, exact)
    assert p > 1e-3, f"ASAp ({drafter}) after warm-up does not follow the exact distribution (p={p:.2g})"


def test_asap_trie_rule_on_the_worked_example():
    """The module docstring's example: EFG(a) = 0.1 after one visit, so ``a`` is drawn with 0.47."""
    a, b, c, end = 1, 2, 3, 0
    trie = AsapTrie()
    trie.observe((), torch.tensor([0.0, 0.9, 0.1, 0.0]))
    assert trie.weights((), 4) is None  # nothing learned yet: plain masking
    trie.observe((a,), torch.tensor([0.0, 0.0, 0.0, 0.1]))  # after a only c is legal
    trie.observe((a, c), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    trie.update((a, c, end), {end})
    w = trie.weights((), 4)
    assert w.tolist() == pytest.approx([1.0, 0.1, 1.0, 1.0])
    q = torch.tensor([0.0, 0.9, 0.1, 0.0]) * w
    assert float(q[a] / q.sum()) == pytest.approx(0.09 / 0.19)
    trie.observe((b,), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    trie.update((b, end), {end})
    assert trie.weights((), 4)[b] == pytest.approx(1.0)


def test_awrs_step_is_properly_weighted():
    """E[w 1{x = a}] = p(a) for every legal a (so E[w] = Z); the first-phase-only estimate is biased."""
    p = torch.tensor([0.35, 0.05, 0.25, 0.1, 0.15, 0.1])
    legal = {1, 3, 4}
    gen = torch.Generator().manual_seed(0)
    n = 8000
    sums, naive, sq = torch.zeros(6, dtype=torch.float64), 0.0, 0.0
    for _ in range(n):
        x, w = awrs_sample(p, legal.__contains__, gen, extra=2)
        assert x in legal
        sums[x] += w
        sq += w * w
    est = sums / n
    se = math.sqrt(sq / n) / math.sqrt(n)
    for a in legal:
        assert abs(float(est[a]) - float(p[a])) < 5 * se, (a, float(est[a]), float(p[a]))
    # broken variant: phase one alone (w = mass left once the rejected tokens are removed) overestimates Z
    for _ in range(2000):
        order = torch.multinomial(p, 6, replacement=False, generator=gen).tolist()
        k = next(i for i, t in enumerate(order) if t in legal)
        naive += 1 - float(p[order[:k]].sum())
    assert naive / 2000 > float(p[list(legal)].sum()) + 0.1


def test_awrs_step_edge_cases():
    p = torch.tensor([0.5, 0.5, 0.0])
    assert awrs_sample(p, lambda t: t == 2) == (None, 0.0)  # only a zero-probability token is legal
    token, w = awrs_sample(p, lambda t: t == 1, extra=5)  # the pool empties: the exact mass
    assert token == 1 and w == pytest.approx(0.5)
    assert resample([-math.inf, -math.inf], 0) == 0
    assert resample([-math.inf, 0.0, -math.inf], 3) == 1


@pytest.mark.parametrize("drafter", ["ar", "tree"])
def test_awrs_weighted_particles_match_the_exact_distribution(setup, drafter):
    """Single AWRS particles follow masking's distribution; weighted, they estimate the exact one
    (the plain drafter takes AWRS's lazy path, the tree drafter the exact row masses)."""
    tok, _, exact = setup
    grammar = Grammar(SPEC, tok, 8, [0], sampling="awrs", particles=1)
    engine = engine_for(setup, AutoregressiveDrafter() if drafter == "ar" else tc.RandomDrafts(True, seed=2))
    weighted, unweighted = Counter(), Counter()
    n = 600 if drafter == "ar" else 400
    for seed in range(n):
        run = generate_particles(engine, PROMPT, NEW, PARAMS, seed=seed, grammar=grammar, particles=1)
        y = tuple(run.result.tokens)
        assert y in exact
        weighted[y] += math.exp(run.log_weights[0])
        unweighted[y] += 1
    total = sum(weighted.values())
    assert total_variation({k: v / total for k, v in weighted.items()}, exact) < 0.1
    assert total_variation({k: v / n for k, v in unweighted.items()}, exact) > 0.3


def test_awrs_resampled_output_is_close_to_exact(setup):
    """Importance resampling among 8 particles (``Engine.generate``): far closer than masking."""
    tok, _, exact = setup
    grammar = Grammar(SPEC, tok, 8, [0], sampling="awrs", particles=8)
    counts = samples(engine_for(setup), grammar, 150)
    assert total_variation({k: v / 150 for k, v in counts.items()}, exact) < 0.2


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_greedy_requests_mask_under_every_mode(setup, kind):
    """ASAp and AWRS are sampling methods: a greedy request decodes as plain masking does."""
    tok = setup[0]
    model = setup[1] if kind == "llama" else tiny_gemma3(seed=1, vocab=8)
    engine = Engine(HFRunner(model), AutoregressiveDrafter(), tok, eos_token_ids=[0])
    outs = {mode: engine.generate(PROMPT, NEW, grammar=Grammar(SPEC, tok, 8, [0], sampling=mode)).tokens
            for mode in ("mask", "asap", "awrs")}
    assert outs["asap"] == outs["mask"] == outs["awrs"]
    assert tuple(outs["mask"]) in legal_outputs(Grammar(SPEC, tok, 8, [0])) or len(outs["mask"]) == NEW


@pytest.mark.parametrize("kw, message", [
    ({"sampling": "exact"}, "unknown constraint sampling"),
    ({"sampling": "awrs", "particles": 0}, "particles"),
    ({"sampling": "asap", "close_reserve": 4}, "budget closer"),
])
def test_bad_sampling_options_are_refused(setup, kw, message):
    with pytest.raises(SpeculumError, match=message):
        Grammar(SPEC, setup[0], 8, [0], **kw)


@pytest.mark.slow
def test_smollm2_sampled_outputs_match_the_grammar_under_every_mode(smollm2_f32):
    """The packaged model (float32): ASAp and AWRS give grammatical outputs with speculation (ngram),
    and a greedy request is the same under every mode."""
    import re

    from speculum.methods import build_method
    from speculum.prompts import encode_prompt

    model, tok = smollm2_f32
    pattern = "(yes|no), because it is [a-z]{1,8}\\."
    prompt = encode_prompt(tok, "Is the sky blue? Answer yes or no, and why.")
    ar, ngram = build_method("ar", model, tok), build_method("ngram", model, tok)
    greedy = {m: ar.run(prompt, 16, grammar=ar.compile(ConstraintSpec.regex(pattern), sampling=m)).tokens
              for m in ("mask", "asap", "awrs")}
    assert greedy["mask"] == greedy["asap"] == greedy["awrs"]
    params = SamplingParams(temperature=0.8)
    for mode, particles in (("asap", 1), ("awrs", 2)):
        grammar = ngram.compile(ConstraintSpec.regex(pattern), sampling=mode, particles=particles)
        for seed in range(2):
            out = ngram.run(prompt, 16, params, seed=seed, grammar=grammar)
            if out.finish_reason == "stop":
                assert re.fullmatch(pattern, out.text), (mode, out.text)
