"""PEARL (drafters/pearl.py): lossless greedy and sampled output, its post-verify rule (the
continuation drafted while the target verifies is the next chunk exactly when the last chunk was
accepted whole and the bonus token is the continuation's first token) and pre-verify (where no chunk
is ready, the first token is proposed alone and the rest drafted beside its check)."""

from __future__ import annotations

import copy
import threading
from collections import Counter

import pytest
import torch
from conftest import batched_join_midway, tiny_gemma3, tiny_llama
from scipy.stats import chisquare

from speculum.drafters import DRAFTERS
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.pearl import PearlDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams

PROMPT = [1, 5, 9, 13, 2, 7]


def ar_tokens(runner, prompt, new):
    return Engine(runner, AutoregressiveDrafter(), eos_token_ids=[]).generate(prompt, new).tokens


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize(("gamma", "draft_kind"), [(None, "weak"), (3, "copy"), (2, "weak")])
def test_greedy_output_is_ar(family, gamma, draft_kind):
    target = tiny_llama(seed=0) if family == "llama" else tiny_gemma3(seed=0)
    if draft_kind == "copy":
        draft = copy.deepcopy(target)  # drafts the target's own tokens: post-verify hits every step
    else:
        draft = tiny_llama(seed=1, layers=1) if family == "llama" else tiny_gemma3(seed=1)
    runner = NativeRunner(target)
    drafter = PearlDrafter(draft, gamma=gamma)
    engine = Engine(runner, drafter, eos_token_ids=[])
    for prompt in (PROMPT, [3, 3, 3, 3, 40, 41, 42]):
        result = engine.generate(prompt, 30)
        assert result.tokens == ar_tokens(runner, prompt, 30)
    assert drafter.hits + drafter.misses > 0
    if draft_kind == "copy":
        assert drafter.misses == 0 and drafter.hits >= 8


class CountingRunner:
    """Wraps the draft's runner: which thread ran each draft forward."""

    def __init__(self, runner):
        self.runner, self.threads = runner, []

    def forward_tree(self, *args, **kw):
        self.threads.append(threading.current_thread() is threading.main_thread())
        return self.runner.forward_tree(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def proposals_of(drafter) -> list[tuple[list[int], int]]:
    """Wraps ``drafter.propose`` (its runner a :class:`CountingRunner`): each step's proposed tokens
    and how many draft forwards ran in the engine's thread while proposing them."""
    trees = []
    real_propose = drafter.propose

    def propose(tokens, budget):
        before = len(drafter.runner.threads)
        tree = real_propose(tokens, budget)
        trees.append((list(tree.tokens), sum(drafter.runner.threads[before:])))
        return tree

    drafter.propose = propose
    return trees


def test_post_verify_rule_on_a_perfect_draft(llama):
    """A draft that is the target: the first chunk (gamma = 3) is drafted in the foreground; its
    continuation, drafted in the background during verification, starts with the bonus token, so
    every later chunk is the continuation's next three tokens, ready without a foreground forward."""
    runner = NativeRunner(llama)
    drafter = PearlDrafter(copy.deepcopy(llama), gamma=3, pre_verify=False)
    drafter.runner = CountingRunner(drafter.runner)
    trees = proposals_of(drafter)
    result = Engine(runner, drafter, eos_token_ids=[]).generate(PROMPT, 21)
    want = ar_tokens(runner, PROMPT, 21)
    assert result.tokens == want
    first, main_forwards = trees[0]
    assert first == want[:3] and main_forwards == 3  # foreground: 3 forwards
    for step, (tokens, main_forwards) in enumerate(trees[1:-1], start=1):
        assert tokens == want[4 * step:4 * step + 3]  # each step commits 3 accepted + the bonus
        assert main_forwards == 0  # nothing drafted in the engine's thread: it was ready
    assert trees[-1] == ([], 0)  # one token left to make: no room for a draft
    assert drafter.hits == len(trees) - 1 and drafter.misses == 0
    assert [s.committed for s in result.steps] == [4] * 5 + [1]


def test_pre_verify_proposes_the_first_token_alone_and_the_rest_after_its_check(llama):
    """Pre-verify on a perfect draft (gamma = 3): the first step proposes one token, drafted in the
    foreground; the rest of its chunk is drafted beside the target's check of it, and that check's
    bonus token is the continuation's first, so the next step proposes the continuation's next three
    tokens without a foreground forward, and post-verify goes on from there."""
    runner = NativeRunner(llama)
    drafter = PearlDrafter(copy.deepcopy(llama), gamma=3)
    drafter.runner = CountingRunner(drafter.runner)
    trees = proposals_of(drafter)
    result = Engine(runner, drafter, eos_token_ids=[]).generate(PROMPT, 22)
    want = ar_tokens(runner, PROMPT, 22)
    assert result.tokens == want
    assert trees[0] == (want[:1], 1)  # one token, one foreground forward
    assert trees[1] == (want[2:5], 0)  # the rest of the chunk: ready (want[1] was the check's bonus)
    assert [s.committed for s in result.steps][:3] == [2, 4, 4]
    assert drafter.misses == 0 and drafter.hits == len(trees) - 1


@pytest.mark.parametrize("pre_verify", [True, False])
def test_no_reuse_when_the_bonus_differs(llama, pre_verify):
    """A continuation whose first token is not the target's bonus token is dropped: the next
    chunk is drafted afresh (a miss), and the output stays ar's. With pre-verify a fresh chunk is
    its first token alone; without, the whole chunk."""
    runner = NativeRunner(llama)
    drafter = PearlDrafter(copy.deepcopy(llama), gamma=2, pre_verify=pre_verify)
    real_after = drafter.draft_after

    def wrong_first(last, limit, out, stop=None):
        real_after(last, limit, out, stop)
        if threading.current_thread() is not threading.main_thread():
            out.tokens[0] = (out.tokens[0] + 1) % 96  # the continuation's first token is never the bonus
    drafter.draft_after = wrong_first
    result = Engine(runner, drafter, eos_token_ids=[]).generate(PROMPT, 20)
    assert result.tokens == ar_tokens(runner, PROMPT, 20)
    assert drafter.hits == 0 and drafter.misses == len(result.steps) - 1
    assert all(s.drafted == (1 if pre_verify else 2) for s in result.steps[:-1])


def test_sequential_mode_drafts_in_the_engine_thread(llama):
    runner = NativeRunner(llama)
    drafter = PearlDrafter(copy.deepcopy(llama), gamma=3, post_verify=False)
    drafter.runner = CountingRunner(drafter.runner)
    result = Engine(runner, drafter, eos_token_ids=[]).generate(PROMPT, 20)
    assert result.tokens == ar_tokens(runner, PROMPT, 20)
    assert all(drafter.runner.threads) and drafter.hits == drafter.misses == 0


def test_batched_requests_each_keep_ar_output(llama):
    """Forks in one batch: each request's continuation runs beside the others' drafting."""
    runner = NativeRunner(llama)
    engine = Engine(runner, PearlDrafter(copy.deepcopy(llama), gamma=2), eos_token_ids=[])
    prompts = [PROMPT, [3, 3, 3, 3, 40, 41, 42], [7, 8, 9]]
    got = batched_join_midway(runner, engine, prompts, new=20)
    assert got == [ar_tokens(runner, p, 20) for p in prompts]


def test_bad_options_and_registry(llama):
    with pytest.raises(SpeculumError, match="gamma"):
        PearlDrafter(llama, gamma=0)
    with pytest.raises(SpeculumError, match="max_draft"):
        PearlDrafter(llama, max_draft=0)
    with pytest.raises(SpeculumError, match="draft model"):
        build_method("pearl", llama, None)
    assert DRAFTERS["pearl"].needs_draft_model
    method = build_method("pearl", llama, None, draft_model=tiny_llama(seed=1, layers=1), gamma=2)
    assert isinstance(method.engine.drafter, PearlDrafter) and method.engine.drafter.gamma == 2


# -- sampling: the marginal of tokens 4 and 5 of 5-token samples, where post-verify chunks are used --

VOCAB = 8
S_PROMPT = [1, 5, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.97)
NEW = 5


@pytest.fixture(scope="module")
def small():
    return tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)


def exact_last_pair(model) -> dict[tuple[int, int], float]:
    """P(the output's last two tokens) under the target, by enumerating the tokens before them
    (only prefixes of positive probability: top-k leaves few)."""
    mass: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW):
            seqs = list(mass)
            probs = PARAMS.probs(model(torch.tensor([S_PROMPT + list(s) for s in seqs])).logits[:, -1])
            mass = {s + (t,): mass[s] * float(p) for s, row in zip(seqs, probs)
                    for t, p in enumerate(row.tolist()) if p > 0}
    out: Counter = Counter()
    for s, m in mass.items():
        out[s[-2:]] += m
    return dict(out)


def chi2_pvalue(counts: Counter, exact: dict, n: int) -> float:
    cells = [c for c in exact if exact[c] * n >= 5]
    obs = [counts.get(c, 0) for c in cells] + [n - sum(counts.get(c, 0) for c in cells)]
    exp = [exact[c] * n for c in cells] + [n * (1 - sum(exact[c] for c in cells))]
    if exp[-1] < 1e-9:  # every outcome has its own cell
        return 0.0 if obs[-1] else chisquare(obs[:-1], exp[:-1]).pvalue
    return chisquare(obs, exp).pvalue


class ArgmaxPearl(PearlDrafter):
    """Wrong on purpose: drafts the draft's most likely token but reports q as if it had sampled it."""

    def pick(self, probs):
        return int(probs.argmax())


def sample_last_pairs(drafter, model, n: int) -> Counter:
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    return Counter(tuple(engine.generate(S_PROMPT, NEW, PARAMS, seed=500 + i).tokens[-2:]) for i in range(n))


@pytest.mark.parametrize("variant", ["pearl", "argmax_broken"])
def test_sampled_output_keeps_the_target_distribution(small, variant):
    cls = PearlDrafter if variant == "pearl" else ArgmaxPearl
    drafter = cls(tiny_llama(seed=3, vocab=VOCAB, logit_scale=5.0), gamma=2)
    n = 300  # the broken variant fails by far (p below 1e-40 at 400)
    p = chi2_pvalue(sample_last_pairs(drafter, small, n), exact_last_pair(small), n)
    if variant == "pearl":
        assert p > 1e-3, f"chi-square p = {p:.2e}"
        assert drafter.hits > n // 5  # post-verify chunks were really used
    else:
        assert p < 1e-6, f"the broken variant passed: p = {p:.2e}"


@pytest.mark.slow
def test_smollm2_float32_lossless(smollm2_f32):
    """The packaged model in float32, its first 8 layers (with its norm and head) as the draft."""
    model, tok = smollm2_f32
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:8]
    draft.config.num_hidden_layers = 8
    runner = NativeRunner(model)
    prompt = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
    drafter = PearlDrafter(draft)
    got = Engine(runner, drafter, tok).generate(prompt, 24).tokens
    assert got == Engine(runner, AutoregressiveDrafter(), tok).generate(prompt, 24).tokens
    assert drafter.hits + drafter.misses > 0
