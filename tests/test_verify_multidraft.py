"""Multi-draft verification rules (SpecInfer, RSD, SpecTr) keep the target's distribution; judge
decoding (lossy) accepts what its judge says.

Chi-square tests as in test_sampling.py: one node's output against p (fast, many draws), and the
engine's first two tokens on a tiny model against their exact joint. Broken variants must fail.
"""

import itertools
from collections import Counter

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama
from scipy.stats import chisquare
from test_sampling import PARAMS, PROMPT, VOCAB, chi2_pvalue, exact_joint, sample_pairs

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.base import Drafter
from speculum.drafters.draft_model import DraftModelDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree
from speculum.verify import Verifier
from speculum.verify.judge import JudgeHead, JudgeVerifier, judge_rule
from speculum.verify.rsd import RSDVerifier, gumbel_top_k, without_replacement_q
from speculum.verify.rules import VERIFY_RULES, verifier_class
from speculum.verify.spectr import SpecTrVerifier, k_seq_residual, k_seq_rho

ONE = SamplingParams(temperature=1.0)


# --- broken variants -------------------------------------------------------------------------

class SpecInferOnDistinctDraws(Verifier):
    """Wrong on purpose: SpecInfer's residual (as if with replacement) on siblings drawn without."""

    siblings = "without_replacement"


class RSDWithReplacementResidual(RSDVerifier):
    """Wrong on purpose: RSD's walk with each q_j taken as the full q."""

    def pick_child(self, tree, children, p):
        return Verifier.pick_child(self, tree, children, p)


class SpecTrWithoutTransport(SpecTrVerifier):
    """Wrong on purpose: K-SEQ with rho fixed at 1 (no optimal-transport correction)."""

    def pick_child(self, tree, children, p):
        if len(children) < 2:
            return super().pick_child(tree, children, p)
        q = tree.draft_probs[children[0]]
        for c in children:
            x = tree.tokens[c]
            if self._uniform() * q[x].item() < p[x].item():
                return c, p
        return None, k_seq_residual(p, q, len(children), 1.0)


# --- one node, many draws ----------------------------------------------------------------------

P = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
Q = torch.tensor([0.50, 0.25, 0.05, 0.05, 0.10, 0.05])


def node_counts(verifier_cls, siblings: str, k: int, n: int, seed: int = 0) -> Counter:
    """First emitted token over ``n`` verifications of ``k`` siblings drawn from Q as ``siblings`` says."""
    gen = torch.Generator().manual_seed(seed)
    v = verifier_cls(ONE, gen, key=None)
    logits = P.log().expand(k + 1, -1)  # [k + 1, V]: temperature 1 gives back P at the root
    counts: Counter = Counter()
    for _ in range(n):
        if siblings == "iid":
            toks = torch.multinomial(Q, k, replacement=True, generator=gen).tolist()
        else:
            toks = gumbel_top_k(Q, k, gen)
        tree = DraftTree(toks, [-1] * k, Q.expand(k, -1).clone(), siblings=siblings)
        counts[v.accept(tree, logits).tokens[0]] += 1
    return counts


def node_pvalue(counts: Counter, n: int) -> float:
    obs = [counts.get(i, 0) for i in range(len(P))]
    return chisquare(obs, (P.double() / P.double().sum() * sum(obs)).tolist()).pvalue


@pytest.mark.parametrize("rule,siblings", [(Verifier, "iid"), (RSDVerifier, "without_replacement"),
                                           (SpecTrVerifier, "iid")])
def test_each_rule_keeps_p_at_one_node(rule, siblings):
    n = 6000
    assert node_pvalue(node_counts(rule, siblings, 3, n), n) > 1e-3


@pytest.mark.parametrize("broken,siblings", [(SpecInferOnDistinctDraws, "without_replacement"),
                                             (RSDWithReplacementResidual, "without_replacement"),
                                             (SpecTrWithoutTransport, "iid")])
def test_broken_rules_are_detected_at_one_node(broken, siblings):
    n = 6000
    assert node_pvalue(node_counts(broken, siblings, 3, n, seed=1), n) < 1e-6


def test_rules_refuse_trees_drawn_otherwise():
    tree = DraftTree([0, 1], [-1, -1], Q.expand(2, -1).clone(), siblings="iid")
    with pytest.raises(RuntimeError, match="without_replacement"):
        RSDVerifier(ONE, torch.Generator(), None).accept(tree, P.log()[None])
    distinct = DraftTree([0, 1], [-1, -1], Q.expand(2, -1).clone(), siblings="without_replacement")
    with pytest.raises(RuntimeError, match="'iid'"):
        Verifier(ONE, torch.Generator(), None).accept(distinct, P.log()[None])


# --- the papers' rules on constructed examples -------------------------------------------------

def test_rsd_residuals_of_the_worked_example():
    q, p = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    p2 = Verifier.residual(p, q)
    assert torch.allclose(p2, torch.tensor([0.0, 0.5, 0.5]))
    q2 = without_replacement_q(q, [0])
    assert torch.allclose(q2, torch.tensor([0.0, 0.75, 0.25]))
    assert torch.allclose(Verifier.residual(p2, q2), torch.tensor([0.0, 0.0, 1.0]))


def test_gumbel_top_k_draws_without_replacement_in_q_order():
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.7, 0.2, 0.1, 0.0])
    firsts, pairs = Counter(), Counter()
    for _ in range(4000):
        draw = gumbel_top_k(q, 3, gen)
        assert len(set(draw)) == 3 and 3 not in draw  # distinct, never a zero-probability token
        firsts[draw[0]] += 1
        pairs[tuple(draw[:2])] += 1
    assert chisquare([firsts[i] for i in range(3)], [2800, 800, 400]).pvalue > 1e-3
    # P(second = 2 | first = 0) = 0.1 / 0.3
    assert abs(pairs[(0, 2)] / firsts[0] - 1 / 3) < 0.05


def test_spectr_rho_is_the_smallest_feasible_and_exact_on_the_worked_example():
    p, q = torch.tensor([0.4, 0.2, 0.4]), torch.tensor([0.5, 0.5, 0.0])
    rho = k_seq_rho(p, q, 2)
    assert rho == pytest.approx(1.6325, abs=1e-3)
    beta = float(torch.minimum(q, p / rho).sum())
    gain = (1 - (1 - beta) ** 2) / beta
    assert gain <= rho + 1e-6 and k_seq_rho(p, q, 1) == 1.0
    # accepted mass + rejection * residual = p, token by token
    accepted = torch.minimum(q, p / rho) * gain
    total = accepted + (1 - beta) ** 2 * k_seq_residual(p, q, 2, rho)
    assert torch.allclose(total, p, atol=1e-5)


def acceptance_probability(rule: str, p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """Exact probability that one of ``k`` siblings is accepted, by enumerating the draws."""
    if rule == "spectr":
        rho = k_seq_rho(p, q, k)
        return 1 - (1 - float(torch.minimum(q, p / rho).sum())) ** k
    total = 0.0
    for draw in itertools.product(range(len(p)), repeat=k):
        prob, reject, pj, drawn = 1.0, 1.0, p, []
        for x in draw:
            qj = q if rule == "specinfer" else without_replacement_q(q, drawn)
            prob *= float(qj[x])
            if prob == 0:
                break
            reject *= 1 - min(1.0, float(pj[x] / qj[x]))
            pj, drawn = Verifier.residual(pj, qj), drawn + [x]
        total += prob * (1 - reject)
    return total


def test_rsd_accepts_at_least_as_often_as_specinfer():
    """A draft that puts most mass on one token: i.i.d. siblings repeat it, RSD's cover more of p."""
    p, q = torch.tensor([0.3, 0.3, 0.2, 0.2]), torch.tensor([0.7, 0.1, 0.1, 0.1])
    specinfer, rsd = acceptance_probability("specinfer", p, q, 2), acceptance_probability("rsd", p, q, 2)
    assert rsd > specinfer + 0.05
    for seed in range(5):  # and never less, on random pairs
        g = torch.Generator().manual_seed(seed)
        p, q = torch.rand(4, generator=g).softmax(0), (3 * torch.rand(4, generator=g)).softmax(0)
        assert acceptance_probability("rsd", p, q, 3) >= acceptance_probability("specinfer", p, q, 3) - 1e-9


def test_spectr_accepts_more_than_one_draft():
    p, q = torch.tensor([0.3, 0.3, 0.2, 0.2]), torch.tensor([0.7, 0.1, 0.1, 0.1])
    one = acceptance_probability("spectr", p, q, 1)
    assert one == pytest.approx(float(torch.minimum(p, q).sum()))
    assert acceptance_probability("spectr", p, q, 3) > one + 0.1


# --- the engine on a tiny model ----------------------------------------------------------------

class SiblingTreeDrafter(Drafter):
    """Sampled trees from a draft model: ``width`` root children drawn as :attr:`siblings` says
    (i.i.d. or Gumbel-top-k), each with one sampled child."""

    name = "sibling_tree"

    def __init__(self, draft, width=3):
        self.draft, self.width = draft, width

    def _q(self, seq):
        with torch.no_grad():
            return self.params.probs(self.draft(torch.tensor([seq])).logits[0, -1])

    def propose(self, tokens, budget):
        if budget <= 0:
            return DraftTree()
        q0 = self._q(tokens)
        k = min(self.width, budget)
        if self.siblings == "iid":
            toks = torch.multinomial(q0, k, replacement=True, generator=self.generator).tolist()
        else:
            toks = gumbel_top_k(q0, k, self.generator)
        parents, qs = [-1] * len(toks), [q0] * len(toks)
        for node in range(len(toks)):
            if len(toks) >= budget:
                break
            q1 = self._q(tokens + [toks[node]])
            toks.append(int(torch.multinomial(q1, 1, generator=self.generator)))
            parents.append(node)
            qs.append(q1)
        return DraftTree(toks, parents, torch.stack(qs), siblings=self.siblings)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)


@pytest.mark.parametrize("rule", ["rsd", "spectr"])
def test_engine_output_follows_the_target(model, rule):
    """The rules inside the engine (siblings drawn as the rule tells the drafter, two levels). Few
    samples, to stay fast: the one-node tests above carry the power (and the broken variants)."""
    drafter = SiblingTreeDrafter(tiny_llama(seed=4, vocab=VOCAB, logit_scale=5.0))
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[], verifier_cls=verifier_class(rule))
    n = 800
    assert chi2_pvalue(sample_pairs(engine, n, seed0=300), exact_joint(model), n) > 1e-3
    result = engine.generate(PROMPT, 30, PARAMS, seed=1)
    assert result.verify == rule and not result.lossy
    assert 1.1 < result.mean_accepted < 3.0  # drafts were really accepted and rejected


def test_draft_model_chains_verify_alike_under_every_rule(model):
    """draft_model's sampled chains: one child per node, Leviathan/Chen's rule under every rule (the
    same random numbers drawn in the same order: the same text); test_sampling checks it keeps p."""
    draft = tiny_llama(seed=4, vocab=VOCAB, logit_scale=5.0)
    outs = {rule: Engine(NativeRunner(model), DraftModelDrafter(draft, num_draft=3), eos_token_ids=[],
                         verifier_cls=verifier_class(rule)).generate(PROMPT, 40, PARAMS, seed=5)
            for rule in VERIFY_RULES}
    assert len({tuple(o.tokens) for o in outs.values()}) == 1
    assert outs["rsd"].mean_accepted > 1.1


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("rule", list(VERIFY_RULES))
def test_greedy_output_is_ar_under_every_rule(make, rule):
    target, draft = make(seed=0), make(seed=1)
    prompt = [3, 17, 5, 9, 11]
    ar = Engine(NativeRunner(target), AutoregressiveDrafter(), eos_token_ids=[]).generate(prompt, 24).tokens
    for drafter in (DraftModelDrafter(draft, num_draft=3), DraftModelDrafter(draft, top_k=3)):
        engine = Engine(NativeRunner(target), drafter, eos_token_ids=[], verifier_cls=verifier_class(rule))
        assert engine.generate(prompt, 24).tokens == ar


def test_unknown_rule_is_a_clear_error():
    with pytest.raises(SpeculumError, match="specinfer, rsd, spectr"):
        verifier_class("medusa")


# --- judge decoding ------------------------------------------------------------------------------

def constant_judge(score_logit: float, layer: int) -> JudgeHead:
    return JudgeHead(torch.zeros(64), score_logit, layer)


class ChainDrafter(Drafter):
    name = "fixed_chain"

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, tokens, budget):
        return DraftTree.chain(self.tokens[:budget])


def test_judge_accepts_what_the_judge_says():
    target = tiny_llama(seed=0)
    runner = NativeRunner(target)
    drafter = ChainDrafter([7, 8, 9])
    yes = Engine(runner, drafter, eos_token_ids=[], verifier_cls=judge_rule(constant_judge(5.0, 2), warn=False))
    out = yes.generate([3, 17, 5], 4)
    assert out.tokens[:3] == [7, 8, 9] and out.steps[0].accepted == 3  # all accepted, argmax or not
    assert out.lossy and out.verify == "judge" and out.to_dict()["lossy"] is True
    no = Engine(runner, drafter, eos_token_ids=[], verifier_cls=judge_rule(constant_judge(-5.0, 2), warn=False))
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[]).generate([3, 17, 5], 12).tokens
    assert no.generate([3, 17, 5], 12).tokens == ar  # a judge that never approves is greedy verification


def test_judge_prefers_the_target_match_then_the_best_scored_sibling():
    head = JudgeHead(torch.tensor([1.0, 0.0]), 0.0, layer=0, threshold=0.6)
    v = judge_rule(head, warn=False)(SamplingParams(), None, None)
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 5.0], [5.0, 0, 0, 0]])
    tree = DraftTree([0, 1, 3], [-1, -1, 1])  # the target wants 2 at the root: no child matches
    hidden = torch.tensor([[0.0, 0], [0.5, 0], [2.0, 0], [0.0, 0]])  # scores: 0.62, 0.88 for nodes 0, 1
    acc = v.accept(tree, logits, hidden={0: hidden})
    assert acc.path == [1, 2] and acc.tokens == [1, 3, 0]  # node 1 (judge's best), then 3 (target's own)
    with pytest.raises(RuntimeError, match="hidden states"):
        v.accept(tree, logits)


def test_judge_leaves_sampled_requests_exact():
    v = judge_rule(constant_judge(5.0, 0), warn=False)(ONE, torch.Generator().manual_seed(0), None)
    assert isinstance(v, JudgeVerifier)
    n = 3000
    counts = Counter(v.accept(DraftTree([0], [-1]), P.log().expand(2, -1), hidden={0: torch.zeros(2, 64)}).tokens[0]
                     for _ in range(n))
    assert node_pvalue(counts, n) > 1e-3


def test_judge_trainer_learns_the_proxy_label(tmp_path):
    from speculum.train.judge import fit_judge, judge_examples

    runner = NativeRunner(tiny_llama(seed=0, logit_scale=4.0))
    hidden, labels = judge_examples(runner, [[3, 17, 5, 9], [8, 2, 40, 41]], new_tokens=40, ratio=0.5)
    assert hidden.shape == (80, 64) and 0 < labels.float().mean() < 1
    head = fit_judge(hidden, labels, runner.num_layers, steps=200)
    accuracy = ((head.scores(hidden) > 0.5) == labels).float().mean()
    assert accuracy > 0.7
    head.save(tmp_path / "j.pt")
    assert torch.equal(JudgeHead.load(tmp_path / "j.pt").weight, head.weight)
    with pytest.raises(SpeculumError):
        JudgeHead.load(tmp_path / "missing.pt")


def test_cli_options():
    from speculum.cli import build_parser
    from speculum.cli.common import verify_options

    args = build_parser().parse_args(["generate", "--prompt", "x", "--verify", "rsd"])
    assert verify_options(args) == {"verify": "rsd"}
    args = build_parser().parse_args(["bench", "--judge", "j.pt", "--judge-threshold", "0.7"])
    assert verify_options(args) == {"verify": "specinfer", "judge": "j.pt", "judge_threshold": 0.7}
    with pytest.raises(SpeculumError, match="needs --judge"):
        verify_options(build_parser().parse_args(["generate", "--prompt", "x", "--judge-threshold", "0.7"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--verify", "nope"])
