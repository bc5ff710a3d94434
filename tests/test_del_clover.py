"""DEL (``del``: early exit, exit layer and chain length from tracked per-layer acceptance) and Clover
(``clover``: regressive heads with an attention decoder over the context): lossless greedy output
on tiny Llama and Gemma-3, DEL's choice on a constructed acceptance history, and Clover's
regressive connection."""

import random

import pytest
import torch
from conftest import TINY_VOCAB, committed_per_step, random_head, tiny_gemma3, tiny_llama
from test_sampling import VOCAB, chi2_pvalue, exact_joint, sample_pairs

from speculum.drafters import DRAFTERS
from speculum.drafters.clover import CloverDrafter
from speculum.drafters.del_exit import ExitRates, spaced_exits
from speculum.drafting.layer_cost import best_depth
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.heads.clover import CloverConfig, CloverContext, CloverHeads
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.train.clover import sequence_item
from speculum.train.distill import Sample
from speculum.tree import DraftTree


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


def test_del_probes_every_nth_step():
    """``probe_every``: shadow tokens of the prompt, then of every n-th step only."""
    model = tiny_llama(layers=3)
    p = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2]
    counts = {}
    for every in (1, 1000):
        method = build_method("del", model, None, sized=False, exits=[1, 2], decay=1.0, probe_every=every,
                              idle_backoff=1)
        r = method.run(p, 20)
        # the steps' rows: every step but the last (after which the request ended) hands over its committed tokens
        counts[every] = (method.engine.drafter.rates.seen[1], sum(s.committed for s in r.steps[:-1]))
    assert counts[1000][0] == len(p) - 1  # the prompt's rows (all but its last token) only
    assert counts[1][0] == len(p) - 1 + counts[1][1]


def test_del_probes_less_while_it_drafts_nothing():
    """``idle_backoff``: where no exit is worth drafting, the steps' shadow tokens are counted with a
    growing gap (fewer than every step's, more than none), and the output stays ``ar``'s."""
    model = tiny_llama(layers=3)
    p = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2]
    method = build_method("del", model, None, sized=False, exits=[1, 2], decay=1.0, idle_backoff=4)
    drafter = method.engine.drafter
    drafter.costs = {1: 10.0, 2: 10.0}  # a draft forward dearer than a step: nothing is worth drafting
    r = method.run(p, 30)
    assert r.tokens == build_method("ar", model, None).run(p, 30).tokens
    assert not any(s.drafted for s in r.steps)
    steps = sum(s.committed for s in r.steps[:-1])
    assert len(p) - 1 < drafter.rates.seen[1] < len(p) - 1 + steps / 2


def test_del_refuses_bad_exits():
    model = tiny_llama(layers=4)
    with pytest.raises(SpeculumError, match="exits"):
        DRAFTERS["del"].factory(target=model, draft_head=None, exits=[4])
    with pytest.raises(SpeculumError, match="probe_every"):
        DRAFTERS["del"].factory(target=model, draft_head=None, probe_every=0)
    with pytest.raises(SpeculumError, match="decay"):
        DRAFTERS["del"].factory(target=model, draft_head=None, decay=0.0)


# ---- Clover


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("shape", [{"top_k": 1, "max_nodes": 4}, {"top_k": 4, "max_nodes": 24}], ids=["chain", "tree"])
@pytest.mark.parametrize("trimmed", [False, True], ids=["full_vocab", "trimmed_vocab"])
def test_clover_greedy_equals_ar(make, shape, trimmed, tmp_path):
    model = make()
    path = random_head(model, tmp_path / "c.safetensors", trimmed, kind="clover")
    ar = build_method("ar", model, None)
    method = build_method("clover", model, None, draft_head=str(path), sized=False, **shape)
    drafted = 0
    for p in prompts(1) + [repetitive(2)]:
        r = method.run(p, 40)
        assert r.tokens == ar.run(p, 40).tokens
        drafted += sum(s.drafted for s in r.steps)
    assert drafted > 0


def random_clover(dim: int = 16, heads: int = 3, seed: int = 0) -> CloverHeads:
    torch.manual_seed(seed)
    head = CloverHeads(CloverConfig(hidden=dim, num_heads=heads, attn_heads=4))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.freeze()


def test_clover_regressive_connection_makes_each_depth_read_the_path_and_the_context():
    """Head ``k`` at ``t`` reads ``x_{t+1} .. x_{t+k}`` (not later ones) and the features up to ``t``
    (not later ones); shapes ``[B, T, K, D]``."""
    head = random_clover()
    feats, embeds = torch.randn(2, 5, 16), torch.randn(2, 5, 3, 16)
    out = head(feats, embeds)
    assert out.shape == (2, 5, 3, 16)
    changed = embeds.clone()
    changed[:, :, 1] += 1.0  # the token head 2 reads last
    out2 = head(feats, changed)
    assert torch.equal(out2[:, :, 0], out[:, :, 0])  # head 1 does not read it
    assert not torch.allclose(out2[:, :, 1], out[:, :, 1]) and not torch.allclose(out2[:, :, 2], out[:, :, 2])
    later = feats.clone()
    later[:, 3:] += 1.0  # the context after position 2
    out3 = head(later, embeds)
    assert torch.allclose(out3[:, :3], out[:, :3], atol=1e-6)  # causal
    assert not torch.allclose(out3[:, 3:], out[:, 3:])
    earlier = feats.clone()
    earlier[:, 0] += 1.0  # an early context feature reaches every later position's every depth
    out4 = head(earlier, embeds)
    assert not torch.allclose(out4[:, 4, 2], out[:, 4, 2])


def test_clover_drafting_context_computes_what_training_does():
    """The incremental context (features arriving a few at a time) and the regressive steps give the
    heads' training-time outputs at the last position."""
    head = random_clover()
    feats, embeds = torch.randn(1, 7, 16), torch.randn(1, 7, 3, 16)
    want = head(feats, embeds)[0, -1]  # [K, D] at the last position
    context = CloverContext(head)
    for lo, hi in ((0, 4), (4, 5), (5, 7)):
        context.extend(feats[0, lo:hi])
    state, got = context.last[None], []
    for k in range(1, 4):
        state = context.step(state, embeds[0, -1, k - 1][None])
        got.append(context.head(k, state)[0])
    assert torch.allclose(torch.stack(got), want, atol=1e-5)


def test_clover_training_items_label_the_tokens_after_each_position():
    s = Sample(ids=[10, 11, 12, 13, 14], prompt_len=2, kind="chat", feats=torch.zeros(4, 8))
    feats, ids, mask = sequence_item(s, heads=2, max_len=64)
    assert feats.shape == (4, 8)
    assert ids.tolist()[0] == [11, 12, 13] and ids.tolist()[3] == [14, -1, -1]
    # head k at t labels x_{t+1+k}: a response token (position >= 2) that exists
    assert mask.tolist() == [[True, True], [True, True], [True, False], [False, False]]


class MisreportedQ(CloverDrafter):
    """Broken: drafts from the head's q but tells the verifier it drew uniformly (a point mass would
    not do: a point-mass draft is lossless however it was drawn)."""

    def propose(self, tokens, budget):
        tree = super().propose(tokens, budget)
        if tree.draft_probs is None or not len(tree):
            return tree
        return DraftTree.chain(tree.tokens, torch.full_like(tree.draft_probs, 1 / tree.draft_probs.shape[-1]))


@pytest.mark.parametrize("broken", [False, True], ids=["clover", "misreported_q"])
def test_clover_sampling_keeps_the_target_distribution(broken, tmp_path):
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    path = random_head(model, tmp_path / "c.safetensors", seed=2, scale=4.0, kind="clover")
    drafter = (MisreportedQ if broken else CloverDrafter)(model, path)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    n = 2000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=300), exact_joint(model), n)
    if broken:
        assert p < 1e-6, f"the broken variant passed: p = {p:.2e}"
    else:
        assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_clover_training_raises_acceptance(tmp_path):
    """A few seconds of training on the tiny model's own outputs beat the untrained heads."""
    from test_learned_heads import tiny_data

    from speculum.train.clover import CloverTrainer
    from speculum.train.trainer import TrainConfig

    model, samples = tiny_data()
    cfg = TrainConfig(epochs=6, lr=3e-3, batch_pairs=512, vocab=0, checkpoint_every=10_000, eval_depths=3, num_heads=3)
    trainer = CloverTrainer(model, samples, tmp_path / "run", cfg, progress=False)
    untrained = trainer.save(tmp_path / "untrained.safetensors", {})
    top1_before = trainer.evaluate()[0]
    trainer.run()
    trained = trainer.save(tmp_path / "trained.safetensors", {})
    assert trainer.history.evals[-1]["top1"][0] > top1_before

    def accepted(path):
        method = build_method("clover", model, None, draft_head=str(path), top_k=4, max_nodes=16, sized=False)
        return committed_per_step(method, prompts(9, n=4), ar=build_method("ar", model, None))

    before, after = accepted(untrained), accepted(trained)
    assert after > before + 0.3, (before, after)


@pytest.mark.slow
def test_del_on_smollm2_float32_equals_ar(smollm2_f32):
    """The packaged SmolLM2 in float32: DEL's output is ar's, drafting every step (the paper's
    always-draft: SmolLM2's early exits are rarely worth it, so by default DEL mostly drafts nothing)."""
    from speculum.prompts import encode_prompt

    model, tok = smollm2_f32
    ar = build_method("ar", model, tok)
    method = build_method("del", model, tok, sized=False, allow_none=False)
    ids = encode_prompt(tok, "Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape.", True)
    r = method.run(ids, 32)
    assert r.tokens == ar.run(ids, 32).tokens
    assert sum(s.drafted for s in r.steps) > 0
