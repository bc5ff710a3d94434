"""Model-free drafters ADED (``aded``) and STAND (``stand``).

Greedy losslessness against plain decoding on tiny Llama and Gemma-3 models over requests in a
row (the cross-request tables are exercised); each paper's rule on constructed examples; and for
STAND's sampled trees, that the committed tokens are distributed exactly as the target's p when each
Gumbel-top-k sibling carries its conditional q, and that two broken variants (the unconditional q on
every sibling, a point mass claimed for sampled drafts) are detected by the same chi-square test.
"""

import random
from collections import Counter

import pytest
import torch
from conftest import tiny_llama
from scipy.stats import chisquare
from test_lossless_tiny import NEW, _prompts
from test_sampling import PARAMS, PROMPT, VOCAB, chi2_pvalue, exact_joint

from speculum.batching import Batcher, BatchRequest
from speculum.drafters import DRAFTERS
from speculum.drafters.aded import AdedDrafter
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.stand import StandDrafter, gumbel_top_k
from speculum.engine import Engine
from speculum.runners import HFRunner, NativeRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree
from speculum.tree_sizing import CostModel, TreeSizer
from speculum.verify import Acceptance, Verifier

GREEDY = SamplingParams()


# -- greedy losslessness ----------------------------------------------------------------------------

# each row past the root costs half the root's: a node pays above about 0.5
HALF_COST = CostModel([1, 64], [0], [[1.0, 32.5]])
EIGHTH_COST = CostModel([1, 65], [0], [[1.0, 9.0]])  # rows cost an eighth of the root's: nodes above 1/8 pay


@pytest.mark.parametrize("name", ["aded", "stand"])
def test_greedy_equals_ar(tiny_model, name):
    """Greedy output is ar's, with the trees trimmed by the sizer on their calibrated scores."""
    runner = HFRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    assert DRAFTERS[name].scored
    engine = Engine(runner, DRAFTERS[name].factory(), eos_token_ids=[], max_tree=DRAFTERS[name].max_tree,
                    sizer=TreeSizer(EIGHTH_COST))
    drafted = accepted = 0
    for i, prompt in enumerate(_prompts(10, 21)):
        out = engine.generate(prompt, NEW)
        assert out.tokens == ar.generate(prompt, NEW).tokens, f"{name}: prompt {i}"
        drafted += sum(s.drafted for s in out.steps)
        accepted += sum(s.accepted for s in out.steps)
    assert drafted > 0 and accepted > 0


def test_batched_greedy_equals_ar():
    """aded and stand requests share batches (forks share the cross-request tables) and each gives
    ``ar``'s output, as requests join and leave."""
    model = tiny_llama(seed=1)
    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    engines = [Engine(runner, DRAFTERS[name].factory(), eos_token_ids=[], max_tree=12) for name in ("aded", "stand")]
    prompts = _prompts(8, 5)
    reqs, want = [], []
    for i, p in enumerate(prompts):
        n = 10 + 3 * i
        want.append(ar.generate(p, n).tokens)
        reqs.append(BatchRequest(engines[i % 2], p, n))
    got = [r.tokens for r in Batcher(runner, max_batch=3).run(reqs)]
    assert got == want


def test_bad_options_raise_value_error():
    for make in (lambda: AdedDrafter(top_k=0), lambda: AdedDrafter(c_puct=-1), lambda: AdedDrafter(min_prob=1.0),
                 lambda: StandDrafter(widths=()), lambda: StandDrafter(widths=(2, 0)), lambda: StandDrafter(top_k=0),
                 lambda: StandDrafter(max_depth=0)):
        with pytest.raises(ValueError):
            make()


# -- ADED's rule ------------------------------------------------------------------------------------

A, B, C, D = 1, 2, 3, 4
TEXT = [A, B, C, A, B, D, A, B, C, A, B]  # the module docstring's example


def test_aded_trigram_matrix_and_mcts_order():
    drafter = AdedDrafter()
    drafter.reset(TEXT, GREEDY, None)
    row = dict(drafter.distribution(A, B))
    assert row == pytest.approx({C: 2 / 3, D: 1 / 3})
    assert drafter.distribution(B, C) == [(A, 1.0)]
    # iterations 1-3 go deep along the likeliest path (PUCT re-enters c: 2/3 + 2/3 * 1/2 > 1/3)
    tree = drafter.propose(TEXT, 3)
    assert (tree.tokens, tree.parents) == ([C, A, B], [-1, 0, 1])
    # d enters beside c once c's deeper, less likely nodes have pulled its mean value down
    tree = drafter.propose(TEXT, 7)
    assert tree.tokens[:6] == [C, A, B, C, A, B] and (tree.tokens[6], tree.parents[6]) == (D, -1)


def _misses(drafter, tokens: list[int], tree: DraftTree, wrong: int, vocab: int = 32) -> None:
    """One verified step in which the target's next token is ``wrong`` after every node: nothing accepted."""
    logits = torch.full((len(tree) + 1, vocab), -5.0)
    logits[:, wrong] = 5.0
    drafter.update(tokens + [wrong], tree, Acceptance([], [wrong]), logits)


def test_aded_scores_are_calibrated_by_the_targets_hits():
    drafter = AdedDrafter()
    drafter.reset(TEXT, GREEDY, None)
    tree = drafter.propose(TEXT, 3)
    # before any observation: the decile midpoints of P (2/3 -> 0.65, then 1 -> 0.95) multiplied along the path
    assert tree.scores == pytest.approx([0.65, 0.65 * 0.95, 0.65 * 0.95 ** 2])
    assert [tag[0] for tag in tree.tags] == ["aded"] * 3
    assert len(TreeSizer(HALF_COST).select(tree, 16)) == 3  # likely enough to pay for its rows
    for _ in range(8):  # the target never writes c after "a b"
        _misses(drafter, TEXT, drafter.propose(TEXT, 3), wrong=D)
    tree = drafter.propose(TEXT, 3)
    assert tree.tokens == [C, A, B] and tree.scores[0] < 0.25  # the search is unchanged, its scores fell
    assert len(TreeSizer(HALF_COST).select(tree, 16)) == 0


def test_aded_explores_more_with_larger_c_puct():
    greedy_search = AdedDrafter(c_puct=0.1)
    wide_search = AdedDrafter(c_puct=10.0)
    for d in (greedy_search, wide_search):
        d.reset(TEXT, GREEDY, None)
    assert D not in greedy_search.propose(TEXT, 6).tokens  # exploitation: one deep chain
    wide = wide_search.propose(TEXT, 6)
    assert [wide.tokens[i] for i, p in enumerate(wide.parents) if p == -1] == [C, D]  # both children of the root


def test_aded_adapts_to_committed_tokens_and_learns_across_requests():
    drafter = AdedDrafter(local_weight=1.0)
    drafter.reset([5, 6, 7], GREEDY, None)
    assert drafter.distribution(5, 6) == [(7, 1.0)]
    # the target then wrote 5 6 8 twice: the matrix moves toward what it writes
    tokens = [5, 6, 7, 5, 6, 8, 5, 6, 8, 5, 6]
    assert drafter.propose(tokens, 1).tokens == [8]
    assert dict(drafter.distribution(5, 6)) == pytest.approx({8: 2 / 3, 7: 1 / 3})
    drafter.finish(tokens)
    drafter.reset([9, 5, 6], GREEDY, None)  # a new request starts from the global matrix
    assert drafter.propose([9, 5, 6], 1).tokens == [8]
    assert drafter.distribution(41, 42) == []  # unseen pair and unseen token: nothing to draft
    drafter.reset([42], GREEDY, None)
    assert len(drafter.propose([42], 8)) == 0


def test_aded_backs_off_to_bigrams_and_respects_budget_and_depth():
    drafter = AdedDrafter(max_depth=2)
    drafter.reset([1, 2, 3, 9, 3, 4], GREEDY, None)
    assert dict(drafter.distribution(7, 3)) == pytest.approx({4: 0.5, 9: 0.5})  # pair (7, 3) unseen: row of 3
    tree = drafter.propose([7, 3], 32)
    assert max(tree.depths()) <= 2 and len(tree) <= 32
    assert len(drafter.propose(TEXT, 0)) == 0


# -- STAND's rule -----------------------------------------------------------------------------------

CAT, SAT, RAN, IS, ON, DOWN, AWAY, THE = 10, 11, 12, 13, 14, 15, 16, 17


def _logits(dist: dict[int, float], vocab: int = 32) -> torch.Tensor:
    p = torch.zeros(vocab)
    for t, v in dist.items():
        p[t] = v
    return p.log()


def _stand_with_example(params=GREEDY) -> StandDrafter:
    """The module docstring's example, learnt through :meth:`StandDrafter.update` as the target would teach it."""
    drafter = StandDrafter(top_k=3, widths=(2, 1))
    drafter.reset([THE], params, torch.Generator().manual_seed(0))
    for word, dist in ((SAT, {ON: 0.9, DOWN: 0.1}), (RAN, {AWAY: 1.0})):
        # one step: root CAT, its row predicts after "the cat"; the accepted node's row predicts after "cat word"
        tree = DraftTree.chain([word])
        logits = torch.stack([_logits({SAT: 0.6, RAN: 0.3, IS: 0.1}), _logits(dist)])
        drafter.update([THE, CAT, word, ON], tree, Acceptance([0], [word, ON]), logits)
    return drafter


def test_stand_update_stores_the_targets_distribution_under_each_ngram():
    drafter = _stand_with_example()
    assert dict(drafter.lookup([THE, CAT])) == pytest.approx({SAT: 0.6, RAN: 0.3, IS: 0.1}, abs=1e-6)
    assert dict(drafter.lookup([CAT, SAT])) == pytest.approx({ON: 0.9, DOWN: 0.1}, abs=1e-6)
    assert dict(drafter.lookup([99, SAT])) == pytest.approx({ON: 0.9, DOWN: 0.1}, abs=1e-6)  # the unigram's
    assert drafter.lookup([98, 99]) == []
    assert drafter.vocab == 32


def test_stand_greedy_drafts_the_argmax_tree():
    drafter = _stand_with_example()
    tree = drafter.propose([THE, CAT], 8)
    assert tree.draft_probs is None  # point masses: the greedy walk verifies them
    assert (tree.tokens, tree.parents) == ([SAT, RAN, ON, AWAY], [-1, -1, 0, 1])


def test_stand_greedy_scores_are_calibrated_and_sampled_trees_carry_none():
    drafter = _stand_with_example()
    tree = drafter.propose([THE, CAT], 8)
    # before any observation: decile midpoints of q (0.6 -> 0.65, 0.3 -> 0.35, 0.9 -> 0.95, 1 -> 0.95)
    assert tree.scores == pytest.approx([0.65, 0.35, 0.65 * 0.95, 0.35 * 0.95])
    assert len(TreeSizer(HALF_COST).select(tree, 16)) == 2  # "sat" and "on" pay for their rows
    _misses(drafter, [THE, CAT], drafter.propose([THE, CAT], 2), wrong=IS)  # the target writes "is"
    assert drafter.rates.stats == {tree.tags[0][1]: [0.0, 1.0], tree.tags[1][1]: [0.0, 1.0]}
    assert drafter.rates.p(tree.tags[0][1]) < 0.65 and drafter.rates.p(tree.tags[1][1]) < 0.35
    again = drafter.propose([THE, CAT], 8)
    for i, p in enumerate(again.parents):
        assert again.scores[i] == pytest.approx((again.scores[p] if p >= 0 else 1.0) * drafter.rates.p(again.tags[i][1]))
    sampled = _stand_with_example(SamplingParams(temperature=1.0)).propose([THE, CAT], 8)
    assert sampled.scores is None  # a score depending on the draw would bias it: sampled trees are not sized


def test_stand_prompt_ngrams_draft_from_counts():
    drafter = StandDrafter()
    drafter.reset([1, 2, 3, 1, 2, 4, 1, 2], GREEDY, None)
    assert dict(drafter.lookup([1, 2])) == pytest.approx({3: 0.5, 4: 0.5})
    assert drafter.propose([1, 2], 1).tokens == [3]  # ties: the smaller token


def test_stand_sampled_tree_carries_conditional_q():
    drafter = _stand_with_example(SamplingParams(temperature=1.0))
    tree = drafter.propose([THE, CAT], 8)
    assert tree.draft_probs is not None and tree.draft_probs.shape == (len(tree), 32)
    kids = tree.children()[0]
    assert len(kids) == 2 and {tree.tokens[k] for k in kids} <= {SAT, RAN, IS}
    q0 = {SAT: 0.6, RAN: 0.3, IS: 0.1}
    first, second = (tree.tokens[k] for k in kids)
    assert tree.draft_probs[kids[0], first] == pytest.approx(q0[first], abs=1e-6)
    left = 1 - q0[first]  # the second sibling was drawn with the first removed
    assert tree.draft_probs[kids[1], first] == 0
    assert tree.draft_probs[kids[1], second] == pytest.approx(q0[second] / left, abs=1e-6)
    assert torch.allclose(tree.draft_probs.sum(-1), torch.ones(len(tree)))
    again = drafter.propose([CAT, SAT], 8)  # the rows are rewritten in place: nothing of the last tree stays
    assert again.tokens[0] in (ON, DOWN) and torch.allclose(again.draft_probs.sum(-1), torch.ones(len(again)))


def test_gumbel_top_k_samples_without_replacement():
    """The first two Gumbel-top-k draws follow sequential sampling without replacement exactly."""
    dist = [(0, 0.5), (1, 0.3), (2, 0.15), (3, 0.05)]
    p = dict(dist)
    rng = random.Random(0)
    n = 20000
    counts = Counter(tuple(t for t, _, _ in gumbel_top_k(dist, 2, rng)) for _ in range(n))
    cells = [(a, b) for a in p for b in p if a != b]
    exact = [p[a] * p[b] / (1 - p[a]) * n for a, b in cells]
    assert chisquare([counts[c] for c in cells], exact).pvalue > 1e-3


# -- STAND under sampling: exactness of Gumbel-top-k siblings ---------------------------------------

P_TARGET = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.05, 0.05, 0.03, 0.02])
Q_DRAFT = [(7, 0.35), (6, 0.25), (5, 0.2), (1, 0.1), (0, 0.1)]  # far from p: siblings matter


def _first_tokens(verifier: Verifier, make_tree, n: int, seed: int) -> Counter:
    rng = random.Random(seed)
    logits = P_TARGET.log()[None].expand(4, -1)  # [n + 1, V]: the root's row decides the first token
    return Counter(verifier.accept(make_tree(rng), logits).tokens[0] for _ in range(n))


def _siblings(rng: random.Random, conditional: bool = True, claim_q: bool = True, sample: bool = True) -> DraftTree:
    picks = gumbel_top_k(Q_DRAFT, 3, rng) if sample else [(t, p, q) for t, p, q in _top_in_order(3)]
    tokens = [t for t, _, _ in picks]
    if not claim_q:
        return DraftTree(tokens, [-1] * 3)  # point masses: exact whatever chose the tokens, accepted less often
    qs = [q if conditional else Q_DRAFT for _, _, q in picks]  # broken: i.i.d. q for draws without replacement
    dense = torch.zeros(3, VOCAB)
    for i, q in enumerate(qs):
        for t, v in q:
            dense[i, t] = v
    return DraftTree(tokens, [-1] * 3, dense)


def _top_in_order(k: int) -> list:
    """The ``k`` likeliest tokens of Q_DRAFT, each with the conditional q it would carry if sampled."""
    out, taken = [], set()
    for t, p in Q_DRAFT[:k]:
        left = 1 - sum(pt for tt, pt in Q_DRAFT if tt in taken)
        out.append((t, p, [(tt, pt / left) for tt, pt in Q_DRAFT if tt not in taken]))
        taken.add(t)
    return out


def _pvalue(counts: Counter, n: int) -> float:
    expected = P_TARGET.double() / P_TARGET.double().sum() * n
    return chisquare([counts[t] for t in range(VOCAB)], expected.tolist()).pvalue


EXACT = {"conditional_q": True, "point_mass_claimed": True, "unconditional_q": False, "argmax_drafts_claiming_q": False}


@pytest.mark.parametrize("variant", list(EXACT))
def test_gumbel_siblings_verified_exactly_only_with_conditional_q(variant):
    """``Verifier.accept_sampled``'s loop is exact for without-replacement siblings when each
    carries its conditional q (Recursive Speculative Decoding), and for any drafts verified as point
    masses; it is not when siblings carry the unconditional q (the i.i.d. rule on draws without
    replacement) or when deterministic drafts claim the q they were not sampled from."""
    verifier = Verifier(SamplingParams(temperature=1.0), torch.Generator().manual_seed(1), key=None)
    make = {"conditional_q": _siblings,
            "unconditional_q": lambda rng: _siblings(rng, conditional=False),
            "point_mass_claimed": lambda rng: _siblings(rng, claim_q=False),
            "argmax_drafts_claiming_q": lambda rng: _siblings(rng, sample=False)}[variant]
    n = 4000  # broken variants reach p < 1e-50 at 3000 draws
    p = _pvalue(_first_tokens(verifier, make, n, seed=3), n)
    if EXACT[variant]:
        assert p > 1e-3, f"{variant}: chi-square p = {p:.2e}"
    else:
        assert p < 1e-6, f"{variant} not detected: p = {p:.2e}"


def test_sampled_q_is_accepted_more_often_than_point_masses():
    """What STAND's q buys: with q near p the first sibling is accepted with probability
    ``sum min(p, q)``, against ``sum q p`` for the same draws verified as point masses."""
    verifier = Verifier(SamplingParams(temperature=1.0), torch.Generator().manual_seed(2), key=None)
    logits = P_TARGET.log()[None].expand(2, -1)
    near = [(t, float(v)) for t, v in enumerate(P_TARGET)]
    rng = random.Random(4)
    hits = {True: 0, False: 0}
    for _ in range(4000):
        (tok, _, q), = gumbel_top_k(near, 1, rng)
        dense = torch.tensor([[dict(q).get(t, 0.0) for t in range(VOCAB)]])
        for claim in (True, False):
            tree = DraftTree([tok], [-1], dense if claim else None)
            hits[claim] += len(verifier.accept(tree, logits).path)
    assert hits[True] > 0.97 * 4000 and hits[False] < 0.3 * 4000


class FrozenStand(StandDrafter):
    """STAND over a fixed table far from the target (no learning), so that sampled siblings and
    their q decide what is accepted."""

    def update(self, tokens, tree, acceptance, logits):
        pass


def _frozen_stand() -> StandDrafter:
    drafter = FrozenStand(widths=(3, 2))
    drafter.vocab = VOCAB
    for ctx in ([PROMPT[-1]],) + tuple([t] for t in range(VOCAB)):
        drafter._store(ctx, {7: 0.35, 6: 0.25, 5: 0.2, 1: 0.1, 0: 0.1})
    return drafter


@pytest.fixture(scope="module")
def sampling_model():
    return tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)


@pytest.mark.parametrize("drafter", ["learning", "frozen_far_q"])
def test_stand_sampling_keeps_the_target_distribution(sampling_model, drafter):
    """Two generated tokens through the engine: their joint distribution is the target's."""
    stand = StandDrafter(widths=(3, 2)) if drafter == "learning" else _frozen_stand()
    engine = Engine(NativeRunner(sampling_model), stand, eos_token_ids=[])
    n = 1500  # (the direct test above shows the power of the check on broken variants)
    counts = Counter(tuple(engine.generate(PROMPT, 2, PARAMS, seed=9000 + i).tokens) for i in range(n))
    p = chi2_pvalue(counts, exact_joint(sampling_model), n)
    assert p > 1e-3, f"{drafter}: chi-square p = {p:.2e}"
    out = engine.generate(PROMPT, 40, PARAMS, seed=1)
    assert out.mean_accepted > 1.1  # drafts were sampled and accepted


# -- the packaged model -----------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_float32_greedy_equals_ar(smollm2_f32):
    from speculum.methods import build_method
    from speculum.prompts import encode_prompt

    model, tok = smollm2_f32
    ids = encode_prompt(tok, "Repeat three times: the quick brown fox jumps over the lazy dog.", chat=True)
    ref = build_method("ar", model, tok).run(ids, 32).tokens
    for name in ("aded", "stand"):
        method = build_method(name, model, tok)
        for _ in range(2):  # the second run starts from what the first taught the tables
            assert method.run(ids, 32).tokens == ref, name
