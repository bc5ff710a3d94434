"""Speculative sampling keeps the target's distribution exactly (chi-square tests on a tiny model).

The exact joint distribution of the first two generated tokens is computed from the model; the
engine's samples are compared with it. A verifier that skips the residual resampling must fail.
"""

import random
from collections import Counter

import pytest
import torch
from conftest import tiny_llama
from scipy.stats import chisquare

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.base import Drafter
from speculum.drafters.draft_model import DraftModelDrafter
from speculum.engine import Engine
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree
from speculum.verify import Verifier

VOCAB = 8
PROMPT = [1, 5, 2]
LIKELY = [0, 2, 4, 6, 7]  # tokens with sizeable probability under the test model
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.97)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)


def exact_joint(model) -> dict[tuple[int, int], float]:
    with torch.no_grad():
        p1 = PARAMS.probs(model(torch.tensor([PROMPT])).logits[0, -1])
        seqs = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        p2 = PARAMS.probs(model(seqs).logits[:, -1])
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


class RandomChainDrafter(Drafter):
    """Deterministic-looking drafts (no probabilities): q is a point mass on each token."""

    name = "random"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def propose(self, tokens, budget):
        return DraftTree.chain([self.rng.choice(LIKELY) for _ in range(min(2, budget))])


class RandomTreeDrafter(Drafter):
    """Random trees without probabilities: 1-3 siblings per level (duplicates allowed), 2 levels,
    tokens drawn from the likelier part of the vocabulary so that drafts are often accepted."""

    name = "random_tree"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def propose(self, tokens, budget):
        toks, parents = [], []
        for _ in range(self.rng.randint(1, 3)):
            if len(toks) >= budget:
                break
            toks.append(self.rng.choice(LIKELY))
            parents.append(-1)
            node = len(toks) - 1
            for _ in range(self.rng.randint(0, 2)):
                if len(toks) < budget:
                    toks.append(self.rng.choice(LIKELY))
                    parents.append(node)
        return DraftTree(toks, parents)


class SampledTreeDrafter(Drafter):
    """SpecInfer-style trees: at each level ``width`` siblings drawn i.i.d. from a draft model's q."""

    name = "sampled_tree"

    def __init__(self, draft, width=2):
        self.draft, self.width = draft, width

    def _q(self, seq):
        with torch.no_grad():
            return self.params.probs(self.draft(torch.tensor([seq])).logits[0, -1])

    def propose(self, tokens, budget):
        toks, parents, qs = [], [], []
        q0 = self._q(tokens)
        for _ in range(min(self.width, budget)):
            x = int(torch.multinomial(q0, 1, generator=self.generator))
            toks.append(x)
            parents.append(-1)
            qs.append(q0)
        for node in range(len(toks)):
            if len(toks) >= budget:
                break
            q1 = self._q(tokens + [toks[node]])
            toks.append(int(torch.multinomial(q1, 1, generator=self.generator)))
            parents.append(node)
            qs.append(q1)
        return DraftTree(toks, parents, torch.stack(qs) if qs else None)


class RejectionVerifier(Verifier):
    """Rejection sampling for every tree (keyed sampling off): the point-mass path of SpecInfer's rule."""

    keyed = False


class NoResidualVerifier(RejectionVerifier):
    """Wrong on purpose: after a rejection it samples from p instead of norm(max(0, p - q))."""

    @staticmethod
    def residual(p, q):
        return p


class UnkeyedPositionVerifier(Verifier):
    """Wrong on purpose: keyed sampling that reuses one uniform for every position."""

    def keyed_token(self, probs, position):
        return super().keyed_token(probs, 0)


def sample_pairs(engine, n, seed0):
    return Counter(tuple(engine.generate(PROMPT, 2, PARAMS, seed=seed0 + i).tokens) for i in range(n))


def chi2_pvalue(counts: Counter, exact: dict, n: int) -> float:
    cells = sorted(exact, key=exact.get, reverse=True)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for c in cells:
        if exact[c] * n >= 5:
            obs.append(counts.get(c, 0))
            exp.append(exact[c] * n)
        else:
            rest_o += counts.get(c, 0)
            rest_e += exact[c] * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    elif rest_o:
        return 0.0  # outcomes that have probability 0 under the target
    total = sum(exp)
    exp = [e * sum(obs) / total for e in exp]
    return chisquare(obs, exp).pvalue


def test_distribution_is_not_degenerate(model):
    exact = exact_joint(model)
    assert max(exact.values()) < 0.5 and sum(v > 0.01 for v in exact.values()) >= 8


@pytest.mark.parametrize("variant", ["ar", "point_mass_drafts", "draft_model_q", "point_mass_tree",
                                     "sampled_tree_q", "point_mass_drafts_rejection", "point_mass_tree_rejection"])
def test_speculative_sampling_matches_target_distribution(model, variant):
    """Keyed sampling (point-mass drafts, the default) and rejection sampling both keep p."""
    runner = NativeRunner(model)
    verifier_cls = RejectionVerifier if variant.endswith("_rejection") else Verifier
    variant = variant.removesuffix("_rejection")
    if variant == "ar":
        drafter = AutoregressiveDrafter()
    elif variant == "point_mass_drafts":
        drafter = RandomChainDrafter()
    elif variant == "draft_model_q":
        # SpecDec++'s stop: a rule on the draft's own probabilities, which must not bend p
        drafter = DraftModelDrafter(tiny_llama(seed=3, vocab=VOCAB, logit_scale=5.0), num_draft=2, stop_risk=0.6)
    elif variant == "point_mass_tree":
        drafter = RandomTreeDrafter()
    else:
        drafter = SampledTreeDrafter(tiny_llama(seed=4, vocab=VOCAB, logit_scale=5.0))
    engine = Engine(runner, drafter, eos_token_ids=[], verifier_cls=verifier_cls)
    n = 12000  # (the broken-verifier tests below show the test's power at 20k)
    counts = sample_pairs(engine, n, seed0=1000)
    p = chi2_pvalue(counts, exact_joint(model), n)
    assert p > 1e-3, f"{variant}: chi-square p = {p:.2e}"
    if variant != "ar":  # drafts were really accepted and rejected
        acc = engine.generate(PROMPT, 40, PARAMS, seed=1).mean_accepted
        assert 1.1 < acc < 3.0


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_skipping_residual_resampling_is_detected(model, shape):
    drafter = RandomChainDrafter() if shape == "chain" else RandomTreeDrafter(seed=1)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[], verifier_cls=NoResidualVerifier)
    n = 20000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=5000), exact_joint(model), n)
    assert p < 1e-6


def test_keyed_sampling_that_reuses_one_uniform_is_detected(model):
    engine = Engine(NativeRunner(model), RandomChainDrafter(), eos_token_ids=[], verifier_cls=UnkeyedPositionVerifier)
    n = 20000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=7000), exact_joint(model), n)
    assert p < 1e-6


def test_seeded_sampling_is_the_same_under_every_drafter(model):
    """Keyed sampling: a seed fixes the text, whatever the drafts (float32: exact logits)."""
    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    chain = Engine(runner, RandomChainDrafter(seed=2), eos_token_ids=[])
    tree = Engine(runner, RandomTreeDrafter(seed=3), eos_token_ids=[])
    for seed in (0, 11, -5, (1 << 64) - 1):
        want = ar.generate(PROMPT, 24, PARAMS, seed=seed).tokens
        for _ in range(3):  # the random drafters propose different trees each time
            assert chain.generate(PROMPT, 24, PARAMS, seed=seed).tokens == want
            assert tree.generate(PROMPT, 24, PARAMS, seed=seed).tokens == want
    texts = {tuple(ar.generate(PROMPT, 24, PARAMS, seed=s).tokens) for s in range(8)}
    assert len(texts) > 4  # and different seeds give different texts


def native_joint(runner) -> dict[tuple[int, int], float]:
    """:func:`exact_joint` from the native runner's one-token steps (a quantized model has no
    transformers forward)."""
    def last(seq):
        cache = runner.new_cache(16)
        runner.prefill(cache, seq[:-1])
        return runner.forward(cache, seq[-1], DraftTree()).logits[0]

    p1 = PARAMS.probs(last(PROMPT))
    p2 = torch.stack([PARAMS.probs(last(PROMPT + [a])) for a in range(VOCAB)])
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


def test_sampling_on_quantized_weights_keeps_their_distribution():
    """On int4 weights (the quantized kernels), speculative sampling over keyed point-mass trees draws
    from the quantized model's own distribution, which differs from the float model's (the verifier's
    other paths do not depend on the weights' format: the float tests above cover them)."""
    from speculum.weights.quantize_model import quantize_model

    qmodel = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    quantize_model(qmodel, "int4")
    runner = NativeRunner(qmodel)
    exact = native_joint(runner)
    float_exact = exact_joint(tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0))
    assert max(abs(exact[c] - float_exact[c]) for c in exact) > 1e-4  # another model
    engine = Engine(runner, RandomTreeDrafter(), eos_token_ids=[])
    n = 12000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=5000), exact, n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
