"""Tree drafters (suffix, recycling, ngram trees, mix, auto) and tree sizing.

Greedy losslessness against plain decoding on tiny random Llama and Gemma-3 models (float32),
with and without the hardware-aware sizer, over many requests in a row so that cross-request
state (the suffix drafter's global trie, the recycling matrix, auto's bandit) is exercised; plus
unit checks of the suffix trie against brute force, the sizer's choices and the bandit.
"""

import random
from collections import Counter

import pytest
import torch
from test_lossless_tiny import NEW, _prompts

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.auto import AutoDrafter
from speculum.drafters.mix import MixDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.drafters.recycling import RecyclingDrafter
from speculum.drafters.suffix import SuffixDrafter
from speculum.drafters.suffix_index import SuffixIndex
from speculum.drafters.suffix_merged import SuffixMergedDrafter
from speculum.engine import Engine
from speculum.runners import HFRunner
from speculum.tree import DraftTree
from speculum.tree_sizing import CostModel, TreeSizer, best_size
from speculum.verify import Acceptance

DRAFTERS = {
    "suffix": lambda: SuffixDrafter(),
    "suffix_merged_wide": lambda: SuffixMergedDrafter(max_spec_factor=8.0, min_token_prob=0.0, max_match=4),
    "recycling": lambda: RecyclingDrafter(),
    "recycling_scored_k2_deep": lambda: RecyclingDrafter(k=2, tree="scored", pair_context=True, max_depth=30),
    "ngram_tree": lambda: NgramDrafter(branches=4, branch_draft=3),
    "ngram_scored": lambda: NgramDrafter(scored=True),
    "mix": lambda: MixDrafter([SuffixMergedDrafter(), RecyclingDrafter(tree="scored", pair_context=True)]),
    "auto": lambda: AutoDrafter(),
}


@pytest.mark.parametrize("sized", [False, True], ids=["unsized", "sized"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_tree_drafters_lossless(tiny_model, name, sized):
    runner = HFRunner(tiny_model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    # a fixed cost model in which a row costs a tenth of a step: the sized trees then keep nodes whatever
    # the machine's measured costs (under a loaded CPU a measured model can rightly shrink every tree to nothing)
    sizer = TreeSizer(CostModel(tokens=[1, 64], contexts=[64], seconds=[[0.010, 0.073]])) if sized else None
    engine = Engine(runner, DRAFTERS[name](), eos_token_ids=[], sizer=sizer)
    drafted = accepted = 0
    for i, prompt in enumerate(_prompts(40, 11)):
        out = engine.generate(prompt, NEW)
        assert out.tokens == ar.generate(prompt, NEW).tokens, f"{name}: prompt {i}"
        drafted += sum(s.drafted for s in out.steps)
        accepted += sum(s.accepted for s in out.steps)
    assert drafted > 0
    if not sized:  # the unsized trees are big enough that some drafts must land
        assert accepted > 0


def test_unsized_recycling_grows_wide_trees(tiny_model):
    runner = HFRunner(tiny_model)
    engine = Engine(runner, RecyclingDrafter(), eos_token_ids=[])
    for prompt in _prompts(5, 12):
        engine.generate(prompt, NEW)
    out = engine.generate([1, 2, 3, 1, 2, 3], NEW)
    assert max(s.drafted for s in out.steps) >= 32


# -- suffix trie ----------------------------------------------------------------------------------

def _brute_counts(seqs, depth):
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


def _trie_counts(index):
    out, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for child in index.children(node):
            tok = index.token[child]
            assert index.child(node, tok) == child
            out[path + (tok,)] = index.count[child]
            stack.append((child, path + (tok,)))
    return out


def test_suffix_index_counts_match_brute_force():
    rng = random.Random(0)
    seqs = {k: [rng.randrange(5) for _ in range(rng.randint(1, 40))] for k in range(6)}
    index = SuffixIndex(max_depth=6)
    for k, s in seqs.items():  # insert in pieces: incremental extension must equal one insertion
        cut = rng.randint(0, len(s))
        index.extend(k, s[:cut])
        index.extend(k, s[cut:])
    assert _trie_counts(index) == dict(_brute_counts(seqs.values(), 6))
    for k in (1, 4):
        index.remove(k)
        del seqs[k]
        assert _trie_counts(index) == dict(_brute_counts(seqs.values(), 6))
    index.extend(9, [0, 1, 2, 3])  # freed nodes are reused correctly
    seqs[9] = [0, 1, 2, 3]
    assert _trie_counts(index) == dict(_brute_counts(seqs.values(), 6))


def test_suffix_longest_match_is_longest_with_continuation():
    rng = random.Random(1)
    for _ in range(200):
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        index = SuffixIndex(max_depth=12)
        index.extend(0, seq)
        _, m = index.longest_match(seq, 8)
        # brute force: longest suffix (<= 8) that also occurs earlier followed by a token
        best = 0
        for k in range(1, min(8, len(seq), 11) + 1):
            pat = seq[len(seq) - k:]
            if any(seq[i:i + k] == pat for i in range(len(seq) - k)):
                best = k
        assert m == best, seq


def test_suffix_global_cache_drafts_previous_outputs(tiny_model):
    runner = HFRunner(tiny_model)
    drafter = SuffixMergedDrafter(cache_requests=2)  # the global trie's bookkeeping is SuffixDrafter's
    engine = Engine(runner, drafter, eos_token_ids=[])
    prompt = [5, 17, 33, 2, 8]
    first = engine.generate(prompt, NEW)
    second = engine.generate(prompt, NEW)
    assert second.tokens == first.tokens
    assert second.mean_accepted > 3 * first.mean_accepted / 2 and second.mean_accepted > 4
    for p in ([1, 2], [3, 4], [6, 7]):  # evicted after two more requests
        engine.generate(p, 5)
    assert len(drafter.global_ids) == 2


def test_suffix_paper_rule_uses_the_global_cache(tiny_model):
    """The paper's rule keeps the better of the two tries' trees: on a repeated request the global
    trie's tree (the earlier output) wins and the request needs fewer steps."""
    runner = HFRunner(tiny_model)
    engine = Engine(runner, SuffixDrafter(cache_requests=2), eos_token_ids=[])
    prompt = [5, 17, 33, 2, 8]
    first = engine.generate(prompt, NEW)
    second = engine.generate(prompt, NEW)
    assert second.tokens == first.tokens
    assert second.forwards < first.forwards


def test_suffix_paper_rule_scores_every_match_length():
    """Each match length's tree is scored by its expected accepted tokens and the best one is drafted
    (the module docstring's example): "c" gives d (0.5), "b c" gives d then b (0.5 + 0.5), "a b c"
    occurred only at the end."""
    a, b, c, d, e = 1, 2, 3, 4, 5
    history = [b, c, d, b, c, d, b, c, e, a, b, c]
    drafter = SuffixDrafter()
    drafter.reset(history, None, None)
    tree = drafter.propose(history, 8)
    assert tree.tokens == [d, b] and tree.parents == [-1, 0]
    assert tree.scores == pytest.approx([0.5, 0.5])


# -- recycling -------------------------------------------------------------------------------------

def test_recycling_matrix_holds_latest_topk():
    import torch

    d = RecyclingDrafter(k=3, tree="scored")
    logits = torch.zeros(3, 10)
    logits[0, [4, 7, 1]] = torch.tensor([3.0, 2.0, 1.0])
    logits[1, [2, 9, 5]] = torch.tensor([3.0, 2.0, 1.0])
    logits[2, [6, 0, 8]] = torch.tensor([3.0, 2.0, 1.0])
    d.learn([1, 4, 4], [0, 1, 4], logits)  # token 4 appears twice: the later row wins
    assert d.matrix[1].tolist() == [4, 7, 1] and d.matrix[4].tolist() == [6, 0, 8]
    tree = d.propose([0, 1], 5)
    assert tree.tokens[0] == 4 and tree.parents[0] == -1
    for i, p in enumerate(tree.parents):
        if p >= 0:
            assert tree.scores[i] <= tree.scores[p]


# -- sizing ----------------------------------------------------------------------------------------

def _cost(per_token_ms):
    toks = [1, 2, 4, 8, 16, 32, 64]
    return CostModel(toks, [64], [[0.015 + per_token_ms * 1e-3 * (n - 1) for n in toks]])


def test_best_size_follows_the_cost_curve():
    scores = [0.9, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01]
    flat, steep = _cost(0.01), _cost(5.0)
    assert best_size(scores, flat, 64) == len(scores)
    assert 0 < best_size(scores, steep, 64) < best_size(scores, _cost(0.5), 64)
    assert best_size([0.01, 0.001], steep, 64) == 0  # drafting does not pay: plain decoding


def test_sizer_keeps_a_valid_subtree():
    rng = random.Random(3)
    sizer = TreeSizer(_cost(0.8))
    for _ in range(100):
        parents, scores = [], []
        for i in range(rng.randint(1, 30)):
            parents.append(rng.randrange(-1, i))
            scores.append((scores[parents[-1]] if parents[-1] >= 0 else 1.0) * rng.random())
        n = len(parents)
        tree = DraftTree([rng.randrange(50) for _ in range(n)], parents, None, scores, list(range(n)))
        kept = sizer.select(tree, 64)
        assert len(kept) <= len(tree)
        DraftTree(kept.tokens, kept.parents)  # parents precede children
        ids = kept.tags  # original node index of each kept node
        for i, p in enumerate(kept.parents):  # the same parent-child links as in the original
            assert tree.parents[ids[i]] == (-1 if p < 0 else ids[p])
        dropped = [tree.scores[i] for i in range(len(tree)) if i not in set(ids)]
        if kept.scores and dropped:
            assert min(kept.scores) >= max(dropped)


def test_cost_model_interpolates():
    c = CostModel([1, 4], [100, 300], [[0.01, 0.04], [0.03, 0.06]])
    assert c.cost(1, 100) == pytest.approx(0.01)
    assert c.cost(2, 100) == pytest.approx(0.02)
    assert c.cost(1, 200) == pytest.approx(0.02)
    assert c.cost(8, 100) == pytest.approx(0.08)  # extrapolated linearly
    assert c.cost(1, 10) == pytest.approx(0.01)


# -- auto ------------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _simulate_auto(outcome, steps=300, **options):
    """Drive ``auto`` with a fake clock: ``outcome(arm) -> (tokens gained, seconds)``; return its choices
    (``options``: more of AutoDrafter's)."""
    clock = FakeClock()
    auto = AutoDrafter(clock=clock, **options)
    auto.reset([1, 2, 3], None, None)
    length = 3
    for _ in range(steps):
        gained, cost = outcome(auto.start_step(length))
        length += gained
        clock.t += cost
    return auto.chosen


def test_auto_bandit_converges_to_the_fastest_arm():
    # simulated: "none" commits 1 token in 16 ms; "mix" 3 tokens in 20 ms; others 1 token in 25 ms
    chosen = _simulate_auto(lambda arm: {"none": (1, 0.016), "mix": (3, 0.020)}.get(arm, (1, 0.025)))
    assert Counter(chosen[-100:])["mix"] >= 80


def test_scored_ngram_chains_learn_their_hit_rates_and_the_sizer_cuts_them():
    """auto's ngram arm scores each chain node by learnt hit rates (each node at most its parent); after
    steps whose first node missed, the next chain scores lower, and a sizer under a steep cost keeps
    less of it than of the fresh chain."""
    drafter = NgramDrafter(scored=True)
    drafter.reset([5, 6, 7, 8, 9, 5, 6], None, None)
    tokens = [5, 6, 7, 8, 9, 5, 6]
    fresh = drafter.propose(tokens, 16)
    assert fresh.tokens[:3] == [7, 8, 9] and fresh.tags[0] == ("ngram", (2, 1, 0))
    assert all(fresh.scores[i] <= fresh.scores[p] for i, p in enumerate(fresh.parents) if p >= 0)
    for _ in range(20):  # the target wanted 0 where the chain said 7
        logits = torch.zeros(len(fresh) + 1, 10)
        logits[:, 0] = 1.0
        drafter.update(tokens, fresh, Acceptance([], [0], [0] * (len(fresh) + 1)), logits)
    learnt = drafter.propose(tokens, 16)
    assert learnt.tokens == fresh.tokens and learnt.scores[0] < 0.5 * fresh.scores[0]
    steep = TreeSizer(CostModel(tokens=[1, 2, 16], contexts=[64], seconds=[[0.010, 0.013, 0.040]]))
    assert len(steep.select(learnt, 7)) < len(steep.select(fresh, 7))


def test_auto_falls_back_to_plain_decoding_when_nothing_pays():
    # drafting costs and never gains
    chosen = _simulate_auto(lambda arm: (1, 0.016 if arm == "none" else 0.019))
    assert Counter(chosen[-100:])["none"] >= 80


def test_auto_retires_a_learned_arm_that_does_not_pay_and_remembers_it(tmp_path):
    """A learned arm slower than the best model-free arm is dropped after a few trials (no more
    exploration, no more hidden states) and recorded; one that pays stays and wins."""
    from speculum.drafters.arm_memory import ArmMemory

    memory = ArmMemory(tmp_path / "retired.json")
    slow, fast = AutoregressiveDrafter(), AutoregressiveDrafter()
    slow.hidden_layers = (3,)
    outcome = {"none": (1, 0.016), "mix": (2, 0.020), "slow": (1, 0.030), "fast": (4, 0.020)}
    chosen = _simulate_auto(lambda arm: outcome.get(arm, (1, 0.025)), learned={"slow": slow, "fast": fast},
                            memory=memory, arm_names={"slow": "eagle:/heads/slow"})
    assert 1 <= Counter(chosen)["slow"] <= 16
    assert "slow" not in chosen[-200:]
    assert Counter(chosen[-100:])["fast"] >= 80
    assert ArmMemory(tmp_path / "retired.json").names == {"eagle:/heads/slow"}
