"""Online adaptation of a learned head (``medusa_online``, ``hydra_online``, ``medusa_online_zo``):
lossless greedy output while the head learns (tiny Llama and Gemma-3, alone and batched), the
target's distribution under sampling (and a stale-q variant detected), the paper's rule on a
constructed example (what the buffer holds, only mistakes learned), the update rules (backprop and
SPSA / MeZO), and acceptance rising on a repetitive stream where a no-op update's does not."""

import random

import pytest
import torch
from conftest import TINY_VOCAB, batched_join_midway, committed_per_step, random_head, tiny_gemma3, tiny_llama
from test_sampling import VOCAB, chi2_pvalue, exact_joint, sample_pairs

from speculum.drafters import DRAFTERS
from speculum.drafters.online_adapt import OnlineAdaptDrafter
from speculum.drafters.online_updates import Batch, distill_loss, head_logits, misses, zeroth_order_step
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.tree import DraftTree

METHODS = ("medusa_online", "hydra_online", "medusa_online_zo")


def prompts(seed: int, n: int = 3, length: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(length)] for _ in range(n)]


def online(model, path, name="medusa_online", **options) -> OnlineAdaptDrafter:
    return DRAFTERS[name].factory(target=model, draft_head=path, **options)


class Method:
    """An engine with a given drafter, run like a built method (``committed_per_step``)."""

    def __init__(self, runner, drafter):
        self.engine = Engine(runner, drafter, eos_token_ids=[])

    def run(self, prompt, new):
        return self.engine.generate(prompt, new)


def weights(drafter: OnlineAdaptDrafter) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in drafter.inner.head.parameters()])


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_greedy_equals_ar_while_the_head_learns(name, make, tmp_path):
    model = make()
    kind = name.split("_")[0]
    path = random_head(model, tmp_path / "h.safetensors", kind=kind)
    runner = NativeRunner(model)
    ar = build_method("ar", model, None, runner=runner)
    drafter = online(model, path, name, every=1, lr=1e-2)
    before = weights(drafter)
    method = Method(runner, drafter)
    committed_per_step(method, prompts(3, length=12 if make is tiny_gemma3 else 6), 40, ar=ar)
    assert drafter.stats.updates > 10
    assert not torch.equal(weights(drafter), before)  # the drafting head really changed


def test_batched_forks_share_one_learning_head(tmp_path):
    """Requests joining mid-way in one forward per step give their solo outputs; every fork
    teaches the one head."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="medusa")
    runner = NativeRunner(model)
    drafter = online(model, path, every=1)
    engine = Engine(runner, drafter, eos_token_ids=[])
    ar = build_method("ar", model, None, runner=runner)
    ps = prompts(4, n=3)
    solo = [ar.run(p, 40).tokens for p in ps]
    assert batched_join_midway(runner, engine, ps) == solo
    fork = drafter.fork()
    assert fork.stats is drafter.stats and fork.inner.head is drafter.inner.head
    assert fork.inner is not drafter.inner
    assert drafter.stats.updates > 10


def test_the_head_learns_in_inference_mode(tmp_path):
    """The server's scheduler steps under ``torch.inference_mode``: the head learns there too."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="hydra")
    runner = NativeRunner(model)
    drafter = online(model, path, "hydra_online", every=1)
    before = weights(drafter)
    with torch.inference_mode():
        got = Method(runner, drafter).run(prompts(2, n=1)[0], 30).tokens
    assert got == build_method("ar", model, None, runner=runner).run(prompts(2, n=1)[0], 30).tokens
    assert drafter.stats.updates > 5 and not torch.equal(weights(drafter), before)


def test_the_loaded_head_is_not_changed(tmp_path):
    """The loaded head is shared by every method of the target: the online drafter learns a copy."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="medusa")
    plain = DRAFTERS["medusa"].factory(target=model, draft_head=path)
    shared = torch.cat([p.flatten().clone() for p in plain.head.parameters()])
    drafter = online(model, path, every=1)
    Method(NativeRunner(model), drafter).run(prompts(1, n=1)[0], 30)
    assert drafter.stats.updates > 0
    assert torch.equal(torch.cat([p.flatten() for p in plain.head.parameters()]), shared)


class StaleQDrafter(OnlineAdaptDrafter):
    """Wrong on purpose: samples its draft from the learning head but attaches the q of the head as
    first loaded (an update racing with drafting)."""

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        if not hasattr(self, "stale"):
            self.stale = type(self.inner.head)(self.inner.head.config)
            self.stale.load_state_dict(self.first)
            self.stale.freeze()

    def propose(self, tokens, budget):
        tree = super().propose(tokens, budget)
        if tree.draft_probs is None or not len(tree):
            return tree
        with torch.inference_mode():
            q = self.inner.q(self.stale.draft_logits(self.inner.feat, self.inner.tables).float()[0])
        return DraftTree.chain(tree.tokens, q[None])


def _sampled_pvalue(tmp_path, cls, n):
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    path = random_head(model, tmp_path / "h.safetensors", seed=2, scale=4.0, kind="medusa", num_heads=1)
    drafter = cls(model, path, every=2, lr=3e-2)
    drafter.first = {k: v.clone() for k, v in drafter.inner.head.state_dict().items()}
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    p = chi2_pvalue(sample_pairs(engine, n, seed0=100), exact_joint(model), n)
    return p, drafter


def test_sampling_keeps_the_target_distribution_while_the_head_learns(tmp_path):
    p, drafter = _sampled_pvalue(tmp_path, OnlineAdaptDrafter, 2000)
    assert drafter.stats.updates > 100  # the requests taught the head
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_a_stale_draft_distribution_is_detected(tmp_path):
    p, _ = _sampled_pvalue(tmp_path, StaleQDrafter, 2000)
    assert p < 1e-3, f"chi-square p = {p:.2e}"


def test_the_buffer_holds_the_targets_outputs_after_each_feature(tmp_path):
    """The paper's rule, on one greedy request: each buffered position j holds the target's feature
    of x_j, the committed x_{j+1} .. x_{j+1+K}, and, for head k, the target's distribution over
    x_{j+1+k} with the committed (greedy) token on top; labels in the prompt are masked."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="medusa", trimmed=True)
    drafter = online(model, path, every=10_000, buffer=1000)  # never updates: the buffer as filled
    prompt = prompts(5, n=1)[0]
    out = Method(NativeRunner(model), drafter).run(prompt, 30)
    tokens = prompt + out.tokens
    k = drafter.depth
    rows = list(drafter.shared.buffer.rows)
    first = len(prompt) - 2
    # every position whose labels were all committed (the last step's root and accepted tokens get no
    # features: the engine hands none over once the request has ended)
    assert len(rows) >= len(tokens) - 1 - k - first - (k + 1)
    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]  # [T, D] final norm
    columns = drafter.shared.columns
    for j, (feat, ids, cols, probs, mask) in enumerate(rows, start=first):
        torch.testing.assert_close(feat, hidden[j], atol=1e-4, rtol=1e-4)
        assert ids.tolist() == tokens[j + 1:j + 2 + k]
        assert cols[:, 0].tolist() == columns[torch.tensor(tokens[j + 2:j + 2 + k])].tolist()
        assert torch.all(probs[:, 0] >= probs[:, 1]) and torch.all(probs.sum(-1) <= 1 + 1e-5)
        assert mask.tolist() == [p >= len(prompt) for p in range(j + 2, j + 2 + k)]


def _batch(drafter, n=16) -> Batch:
    return drafter.shared.buffer.sample(n)


def _filled(tmp_path, **options) -> OnlineAdaptDrafter:
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="medusa")
    drafter = online(model, path, every=10_000, **options)
    method = Method(NativeRunner(model), drafter)
    for p in prompts(6):
        method.run(p, 30)
    return drafter


def test_only_the_heads_mistakes_are_learned(tmp_path):
    """Labels the head already drafts right carry no loss (the buffer of mistakes): relabelled so
    that every label is the head's own top token, an update leaves the head as it is."""
    drafter = _filled(tmp_path)
    shared = drafter.shared
    batch = _batch(drafter)
    with torch.no_grad():
        own = head_logits(shared.master, shared.tables, batch).argmax(-1)  # [B, K]
    right = Batch(batch.feats, batch.ids, own[..., None].expand_as(batch.cols).contiguous(),
                  torch.nn.functional.one_hot(torch.zeros_like(own), batch.cols.shape[-1]).float(), batch.mask)
    assert not misses(head_logits(shared.master, shared.tables, right), right).any()
    before = [p.clone() for p in shared.params]
    with torch.enable_grad():
        shared.learn(right, misses_only=True)
    assert all(torch.equal(a, b) for a, b in zip(before, shared.params, strict=True))
    with torch.enable_grad():
        shared.learn(batch, misses_only=True)  # the true labels: the head moves
    assert not all(torch.equal(a, b) for a, b in zip(before, shared.params, strict=True))


@pytest.mark.parametrize("update", ["backprop", "zo"])
def test_an_update_lowers_the_loss_on_its_batch(update, tmp_path):
    drafter = _filled(tmp_path, update=update, lr=1e-2 if update == "backprop" else 1.0, misses_only=False)
    shared, batch = drafter.shared, _batch(drafter, 64)
    objective = shared.objective(batch, misses_only=False)
    before = float(objective().detach())
    for _ in range(10):
        with torch.enable_grad():
            shared.learn(batch, misses_only=False)
    assert float(objective().detach()) < before - 5e-3


def test_zeroth_order_step_restores_and_descends():
    """SPSA / MeZO on a quadratic: with lr 0 the weights come back to theta; with a small lr each
    step lowers the loss; stepping up the estimate instead (a sign error) raises it."""
    target = torch.linspace(-1, 1, 50)

    def run(lr, steps=20):
        theta = [torch.zeros(50)]
        loss = lambda: ((theta[0] - target) ** 2).sum()
        losses = [float(loss())]
        for s in range(steps):
            zeroth_order_step(loss, theta, lr, 1e-3, seed=s)
            losses.append(float(loss()))
        return theta[0], losses

    theta, _ = run(0.0)
    torch.testing.assert_close(theta, torch.zeros(50), atol=1e-6, rtol=0)
    _, down = run(1e-2)
    assert down[-1] < 0.7 * down[0]
    _, up = run(-1e-2)
    assert up[-1] > down[0]


def test_distill_loss_is_the_cross_entropy_to_the_targets_top_tokens():
    """Two labels, one depth: target {col 1: 0.6, col 2: 0.2, outside the draft vocabulary: 0.2}
    renormalised to {1: 0.75, 2: 0.25}."""
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    batch = Batch(torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[[1, 2, -1]]]),
                  torch.tensor([[[0.6, 0.2, 0.2]]]), torch.ones(1, 1, dtype=torch.bool))
    logq = torch.log_softmax(logits[0, 0], -1)
    want = -(0.75 * logq[1] + 0.25 * logq[2])
    torch.testing.assert_close(distill_loss(logits, batch, batch.mask), want)


def test_adaptation_raises_acceptance_on_a_repetitive_stream(tmp_path):
    """A random head drafts nothing the target accepts; served the same prompts again and again,
    the learning head's tokens per step rise well above it, and a no-op update's (lr 0) do not."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="medusa")
    runner = NativeRunner(model)
    ps = prompts(1)

    def last_round(lr):
        method = Method(runner, online(model, path, every=2, lr=lr))
        return [committed_per_step(method, ps, 40) for _ in range(5)][-1]  # (lossless: tested above)

    untrained = last_round(0.0)
    assert last_round(1e-3) > untrained + 0.4
    assert untrained < 1.2


@pytest.mark.parametrize("options, match", [({"kind": "eagle"}, "medusa or hydra"), ({"update": "sgd2"}, "backprop or zo"),
                                            ({"every": 0}, "at least 1")])
def test_bad_options_are_refused(options, match, tmp_path):
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind="medusa")
    with pytest.raises(SpeculumError, match=match):
        OnlineAdaptDrafter(model, path, **options)


@pytest.mark.slow
def test_packaged_smollm2_greedy_equals_ar(smollm2_f32):
    """The shipped medusa head learning on the packaged model (float32): ar's output."""
    model, tok = smollm2_f32
    runner = NativeRunner(model)
    ids = tok("Repeat this list twice: apple, banana, cherry, date, elderberry, fig.")["input_ids"]
    ref = build_method("ar", model, tok, runner=runner).run(ids, 32).tokens
    method = build_method("medusa_online", model, tok, runner=runner, sized=False, every=2)
    assert method.run(ids, 32).tokens == ref
    assert method.engine.drafter.stats.updates > 0
