"""The ``medusa``, ``hydra``, ``kangaroo`` and ``ppd`` drafters: lossless greedy output for chains and trees
(random heads, trimmed vocabulary or not, tiny Llama and Gemma-3 past its window, alone and
batched), sampled output with the target's distribution, and training on a tiny model raising
acceptance above the untrained heads'. (``eagle`` has its own file.)"""

import functools
import random

import pytest
import torch
from conftest import (
    TINY_VOCAB,
    batched_join_midway,
    committed_per_step,
    random_head,
    random_heads,
    tiny_gemma3,
    tiny_llama,
)
from test_sampling import VOCAB, chi2_pvalue, exact_joint, sample_pairs

from speculum.drafters import DRAFTERS
from speculum.drafters.auto import BATCH_ARM, AutoDrafter
from speculum.engine import Engine, step
from speculum.errors import SpeculumError
from speculum.heads import load_head
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.train import DraftTraining, train_config
from speculum.train.distill import Sample, generate_batched
from speculum.train.kangaroo import KangarooTrainer
from speculum.train.medusa import HydraTrainer, MedusaTrainer, Positions
from speculum.train.ppd import PPDTrainer
from speculum.train.trainer import TrainConfig
from speculum.tree_sizing import CostModel

KINDS = ("medusa", "hydra", "kangaroo", "ppd")


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("shape", [{"top_k": 1, "max_nodes": 4}, {"top_k": 4, "max_nodes": 24},
                                   {"top_k": 8, "max_nodes": 48, "sized": True}],
                         ids=["chain", "tree", "sized_tree"])
@pytest.mark.parametrize("trimmed", [False, True], ids=["full_vocab", "trimmed_vocab"])
def test_greedy_heads_equal_ar(kind, make, shape, trimmed, tmp_path):
    model = make()
    path = random_head(model, tmp_path / "h.safetensors", trimmed, kind=kind)
    ar = build_method("ar", model, None)
    shape = dict(shape)
    sized = shape.pop("sized", False)
    cost = CostModel([1, 16, 64], [64], [[0.01, 0.012, 0.03]]) if sized else None
    method = build_method(kind, model, None, draft_head=str(path), sized=sized, cost_model=cost, **shape)
    drafted = accepted = 0
    for p in prompts(1):
        want = ar.run(p, 48).tokens
        got = method.run(p, 48)
        assert got.tokens == want
        drafted += sum(s.drafted for s in got.steps)
        accepted += sum(s.accepted for s in got.steps)
    assert drafted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_batched_heads_equal_solo(kind, tmp_path):
    """Several requests in one forward per step, joining mid-way, give their solo outputs."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", kind=kind)
    runner = NativeRunner(model)
    drafter = DRAFTERS[kind].factory(target=model, draft_head=path, top_k=3, max_nodes=8)
    engine = Engine(runner, drafter, eos_token_ids=[])
    ar = build_method("ar", model, None, runner=runner)
    ps = prompts(2, n=5)
    solo = [ar.run(p, 40).tokens for p in ps]
    assert batched_join_midway(runner, engine, ps) == solo


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_heads_keep_the_target_distribution(kind, tmp_path):
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    path = random_head(model, tmp_path / "h.safetensors", seed=2, scale=4.0, kind=kind)
    drafter = DRAFTERS[kind].factory(target=model, draft_head=path)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    n = 6000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=100), exact_joint(model), n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_a_head_of_another_kind_is_refused(tmp_path):
    model = tiny_llama()
    eagle = random_head(model, tmp_path / "e.safetensors")
    medusa = random_head(model, tmp_path / "m.safetensors", kind="medusa")
    with pytest.raises(SpeculumError, match="no medusa head"):
        build_method("medusa", model, None, draft_head=str(eagle))
    # several files: each method takes its own kind
    both = (str(eagle), str(medusa))
    assert build_method("medusa", model, None, draft_head=both).engine.drafter.path == medusa
    assert build_method("eagle", model, None, draft_head=both).engine.drafter.path == eagle


@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover", "ppd"])
def test_train_draft_heads_option_sets_the_draft_depth(kind):
    """``train-draft --heads 3`` trains and evaluates 3 depths for every kind with one head per depth."""
    cfg = train_config(DraftTraining.for_kind(kind, heads=3))
    assert (cfg.num_heads, cfg.eval_depths) == (3, 3)


def test_heads_train_on_a_model_with_quantized_weights(tmp_path):
    """A quantized model (GGUF, int8) leaves its LM-head parameter on the meta device: the head
    trains on the CPU all the same (it was moved to meta, and the first step failed)."""
    from speculum.train.clover import CloverTrainer
    from speculum.weights.quantize_model import quantize_model

    model = tiny_llama()
    quantize_model(model, "int8")
    assert model.get_output_embeddings().weight.device.type == "meta"
    gen = torch.Generator().manual_seed(0)
    dim = model.config.hidden_size
    samples = [Sample(list(range(3 + i, 23 + i)), 6, "tiny", torch.randn(19, dim, generator=gen)) for i in range(4)]
    cfg = TrainConfig(epochs=1, batch_pairs=64, vocab=0, checkpoint_every=10_000, eval_depths=2, num_heads=2)
    trainer = CloverTrainer(model, samples, tmp_path, cfg, progress=False)
    trainer.run()
    assert trainer.device.type == "cpu" and trainer.history.steps


def test_positions_label_the_tokens_after_each_feature():
    """Head ``k`` of the feature at ``t`` is trained on ``x_{t+1+k}``, response tokens only."""
    ids = list(range(10, 20))  # T = 10 tokens, the prompt is the first 4
    s = Sample(ids, 4, "tiny", torch.arange(9.0)[:, None].expand(9, 2).clone())
    pos = Positions([s], TrainConfig(num_heads=2), random.Random(0))
    # the first position kept is t = 2 (its head-1 label x_4 is the first response token)
    assert pos.feats[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert pos.ids[0].tolist() == [13, 14, 15]  # x_3 (the LM head's), then heads 1 and 2's labels
    assert pos.mask[0].tolist() == [True, True]
    assert pos.ids[-1].tolist() == [19, -1, -1] and pos.mask[-1].tolist() == [False, False]  # past the end


@functools.cache
def tiny_data(logit_scale: float = 1.0):
    """A tiny model's own greedy answers to random prompts, with its features."""
    model = tiny_llama(seed=5, logit_scale=logit_scale)
    runner = NativeRunner(model)
    rng = random.Random(0)
    train_prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(96)]
    samples = []

    def done(i, response, hidden):
        samples.append(Sample(train_prompts[i] + response, len(train_prompts[i]), "tiny", hidden[runner.num_layers],
                              layers={1: hidden[1]}))

    generate_batched(runner, None, train_prompts, 48, (1, runner.num_layers), batch=16, on_done=done)
    return model, samples


@pytest.mark.parametrize("trainer_cls", [MedusaTrainer, HydraTrainer, KangarooTrainer, PPDTrainer], ids=KINDS)
def test_training_raises_acceptance(trainer_cls, tmp_path):
    """A few seconds of training on the tiny model's own outputs beat the untrained heads. PPD's
    prompt tokens steer the frozen target itself, which a random 2-layer model with flat logits
    barely allows: it gets a model with sharper logits and a smaller margin."""
    ppd = trainer_cls is PPDTrainer
    model, samples = tiny_data(8.0 if ppd else 1.0)
    cfg = TrainConfig(epochs=8, lr=3e-3, batch_pairs=512, vocab=0, checkpoint_every=10_000, eval_depths=3,
                      num_heads=3, exit_layer=1)
    if trainer_cls is KangarooTrainer:
        cfg.eval_depths = 1
    if ppd:
        cfg.lr, cfg.epochs = 3e-2, 4
    trainer = trainer_cls(model, samples, tmp_path / "run", cfg, progress=False)
    untrained = trainer.save(tmp_path / "untrained.safetensors", {})
    top1_before = trainer.evaluate()[0]
    trainer.run()
    trained = trainer.save(tmp_path / "trained.safetensors", {})
    assert trainer.history.evals[-1]["top1"][0] > top1_before

    def accepted(path):
        method = build_method(trainer.kind, model, None, draft_head=str(path), top_k=4, max_nodes=16, sized=False)
        return committed_per_step(method, prompts(9, n=6), ar=build_method("ar", model, None))

    before, after = accepted(untrained), accepted(trained)
    assert after > before + (0.05 if ppd else 0.3), (before, after)
    meta = load_head(trained).meta
    assert meta["vocab"] == TINY_VOCAB and meta["trained_parameters"] > 0


def test_ppd_drafting_reads_what_training_computed(tmp_path):
    """The prompt rows of a verification forward (native runner) give the logits the training forward
    (transformers' modules, many cuts in one pass, ensemble masks) computes for the same prefix."""
    from speculum.tree import DraftTree, PromptRows

    model = tiny_gemma3()
    rng = random.Random(0)
    ids = [rng.randrange(TINY_VOCAB) for _ in range(40)]
    sample = Sample(ids, 10, "tiny", torch.zeros(39, 64))
    cfg = TrainConfig(vocab=0, num_heads=3, eval_depths=3, ensemble=2)
    trainer = PPDTrainer(model, [sample, sample], tmp_path, cfg, progress=False)
    head = trainer.head
    runner = NativeRunner(model)
    for cut in (12, 31):
        with torch.no_grad():
            want = trainer._forward(ids, [7, cut])[1]  # [N * E, V]: the second cut's rows
        cache = runner.new_cache(128)
        runner.prefill(cache, ids[:cut - 1])
        rows = PromptRows([-1] * 6, head.offsets(), head.embeddings.detach(), head.chain_mask())
        got = runner.forward(cache, ids[cut - 1], DraftTree(prompts=rows)).prompt_logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_auto_with_every_learned_arm_equals_ar(tiny_model, tmp_path):
    """``auto`` with an arm per learned drafter stays lossless, and every arm drafts some steps."""
    heads = random_heads(tiny_model, tmp_path)
    auto = build_method("auto", tiny_model, None, draft_head=heads, sized=False)
    assert {"eagle", *KINDS} <= set(auto.engine.drafter.arms)
    ar = build_method("ar", tiny_model, None)
    chosen = set()
    for p in prompts(4, n=8):
        assert auto.run(p, 40).tokens == ar.run(p, 40).tokens
        chosen.update(auto.engine.drafter.chosen)
    assert {"eagle", *KINDS} <= chosen


def test_auto_drafts_with_mix_in_a_batch(tiny_model, tmp_path, monkeypatch):
    """Sharing a step with other sequences, ``auto`` drafts with ``mix`` (a learned arm's forwards
    would hold up the whole batch, and the sizer sizes mix's trees for the batch); alone again, its
    bandit picks among every arm, learned ones included. Lossless throughout."""
    picks = []  # (batched, arm) of every step
    start_step = AutoDrafter.start_step

    def spy(self, length):
        arm = start_step(self, length)
        picks.append((self.batched, arm))
        return arm

    monkeypatch.setattr(AutoDrafter, "start_step", spy)
    auto = build_method("auto", tiny_model, None, draft_head=random_heads(tiny_model, tmp_path), sized=False)
    ar = build_method("ar", tiny_model, None)
    ps, news = prompts(5, n=3), [8, 16, 60]  # the last one ends alone
    engine = auto.engine
    pool = engine.runner.new_pool(len(ps), 128)
    decodings = [engine.start(p, n, cache=pool.acquire(), drafter=engine.drafter.fork()) for p, n in zip(ps, news)]
    while any(d.reason is None for d in decodings):
        step([d for d in decodings if d.reason is None])
    assert [d.generated for d in decodings] == [ar.run(p, n).tokens for p, n in zip(ps, news)]
    batched, alone = {arm for b, arm in picks if b}, {arm for b, arm in picks if not b}
    assert batched == {BATCH_ARM}
    assert alone - {"mix", "ngram", "none"}  # a learned arm drafted alone
