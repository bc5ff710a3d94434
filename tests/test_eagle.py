"""The ``eagle`` drafter: lossless greedy output for every tree shape (random heads, trimmed
vocabulary or not, alone and batched), sampled output with the target's distribution, and
training on a tiny model raising acceptance above the untrained head's."""

import json
import random

import pytest
import torch
from conftest import TINY_VOCAB, batched_join_midway, committed_per_step, random_head, tiny_gemma3, tiny_llama
from test_sampling import PARAMS, PROMPT, VOCAB, RejectionVerifier, chi2_pvalue, exact_joint, sample_pairs

from speculum.drafters.eagle import EagleDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.heads import EagleConfig, EagleHead, load_head, save_head
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.train.distill import Sample, generate_batched
from speculum.train.eagle import EagleTrainer, TrainConfig
from speculum.tree_sizing import CostModel


def prompts(seed: int, n: int = 4, vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("shape", [{"top_k": 1, "depth": 5, "max_nodes": 5}, {"top_k": 4, "depth": 4, "max_nodes": 24},
                                   {"top_k": 8, "depth": 6, "max_nodes": 48, "sized": True}],
                         ids=["chain", "tree", "sized_tree"])
@pytest.mark.parametrize("trimmed", [False, True], ids=["full_vocab", "trimmed_vocab"])
def test_greedy_eagle_equals_ar(make, shape, trimmed, tmp_path):
    model = make()
    path = random_head(model, tmp_path / "h.safetensors", trimmed, scale=8.0)
    ar = build_method("ar", model, None)
    shape = dict(shape)
    sized = shape.pop("sized", False)
    # a cost curve rising with the tree: the sizer trims the drafted tree by its scores
    cost = CostModel([1, 16, 64], [64], [[0.01, 0.012, 0.03]]) if sized else None
    eagle = build_method("eagle", model, None, draft_head=str(path), sized=sized, cost_model=cost, **shape)
    drafted = 0
    for p in prompts(1):
        want = ar.run(p, 48).tokens
        got = eagle.run(p, 48)
        assert got.tokens == want
        drafted += sum(s.drafted for s in got.steps)
    assert drafted > 0


@pytest.mark.parametrize("kind", ["eagle", "hydra", "kangaroo"])
@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_lookups_in_the_text_equal_ar(kind, top_k, tmp_path):
    """On prompts that repeat, the learned drafters' best paths are often found earlier in the text
    (:mod:`speculum.drafters.text_lookup`) and take what followed there; the output is still ``ar``'s.
    A negative ``lookup`` is refused."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", trimmed=False, scale=8.0, kind=kind)
    ar = build_method("ar", model, None)
    rng = random.Random(4)
    ps = []
    for _ in range(4):
        motif = [rng.randrange(TINY_VOCAB) for _ in range(5)]
        ps.append(motif * 4 + [rng.randrange(TINY_VOCAB) for _ in range(3)] + motif[:2])
    shape = {"top_k": top_k, "max_nodes": 12}
    if kind != "hydra":  # hydra drafts one depth per trained head
        shape["depth"] = 2
    if kind == "kangaroo":
        shape["exit_confidence"] = 0.0
    method = build_method(kind, model, None, draft_head=str(path), sized=False, lookup=6, **shape)
    text = method.engine.drafter.text
    found, continuation = [], text.continuation
    text.continuation = lambda *args: found.append(continuation(*args)) or found[-1]
    for p in ps:
        assert method.run(p, 40).tokens == ar.run(p, 40).tokens
    assert any(found)  # lookups were taken
    assert build_method(kind, model, None, draft_head=str(path), lookup=0).engine.drafter.text is None
    with pytest.raises(SpeculumError, match="lookup"):
        build_method(kind, model, None, draft_head=str(path), lookup=-1)


def test_batched_eagle_equals_solo(tmp_path):
    """Several eagle requests in one forward per step (a slot pool) give their solo outputs."""
    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", trimmed=False, scale=8.0)
    runner = NativeRunner(model)
    engine = Engine(runner, EagleDrafter(model, path, top_k=3, depth=3, max_nodes=8), eos_token_ids=[])
    ar = Engine(runner, EagleDrafter(model, path, top_k=1, depth=1, max_nodes=0), eos_token_ids=[])
    ps = prompts(2, n=5)
    solo = [ar.generate(p, 40).tokens for p in ps]
    assert batched_join_midway(runner, engine, ps) == solo


def test_head_that_needs_a_gap_drafts_nothing_rather_than_wrong(tmp_path):
    """Features handed over out of step (never by the engine) stop drafting instead of misaligning."""
    model = tiny_llama()
    drafter = EagleDrafter(model, random_head(model, tmp_path / "h.safetensors", False))
    drafter.reset([1, 2, 3], PARAMS.__class__(), None)
    assert len(drafter.propose([1, 2, 3], 8)) == 0  # the prompt's features never came


class NoResidualVerifier(RejectionVerifier):
    """Wrong on purpose: accepts by ``min(1, p/q)`` but after a rejection samples from p, ignoring
    the drafter's q. (Dropping q altogether would still be exact: the point-mass rule holds for a
    draft chosen any way independent of the target's random numbers.)"""

    @staticmethod
    def residual(p, q):
        return p


@pytest.fixture(scope="module")
def sampling_model():
    return tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)


def test_sampled_eagle_keeps_the_target_distribution(sampling_model, tmp_path):
    path = random_head(sampling_model, tmp_path / "h.safetensors", trimmed=False, seed=2, scale=4.0)
    engine = Engine(NativeRunner(sampling_model), EagleDrafter(sampling_model, path, depth=2), eos_token_ids=[])
    n = 8000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=100), exact_joint(sampling_model), n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    acc = engine.generate(PROMPT, 40, PARAMS, seed=1).mean_accepted
    assert 1.05 < acc  # drafts were accepted (and, below 1 + depth, rejected)


def test_verifier_that_ignores_eagle_q_after_a_rejection_is_detected(sampling_model, tmp_path):
    path = random_head(sampling_model, tmp_path / "h.safetensors", trimmed=False, seed=2, scale=4.0)
    engine = Engine(NativeRunner(sampling_model), EagleDrafter(sampling_model, path, depth=2), eos_token_ids=[],
                    verifier_cls=NoResidualVerifier)
    n = 8000
    p = chi2_pvalue(sample_pairs(engine, n, seed0=100), exact_joint(sampling_model), n)
    assert p < 1e-6


def _train_tiny_eagle(tmp_path, fuse_layers: tuple = ()):
    """Self-distil the tiny Llama on 96 random prompts and train an eagle head on it for a few
    seconds. Returns (model, trainer, untrained head file, trained head file)."""
    model = tiny_llama(seed=5)
    runner = NativeRunner(model)
    rng = random.Random(0)
    train_prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(96)]
    samples = []
    recorded = tuple(sorted({runner.num_layers, *fuse_layers}))

    def done(i, response, hidden):
        samples.append(Sample(train_prompts[i] + response, len(train_prompts[i]), "tiny", hidden[runner.num_layers],
                              layers={k: hidden[k] for k in fuse_layers}))

    generate_batched(runner, None, train_prompts, 48, recorded, batch=16, on_done=done)
    cfg = TrainConfig(epochs=10, lr=3e-3, batch_pairs=1024, vocab=0, unroll=2, checkpoint_every=10_000,
                      eval_depths=2, fuse_layers=fuse_layers)
    trainer = EagleTrainer(model, samples, tmp_path / "run", cfg, progress=False)
    untrained = trainer.save(tmp_path / "untrained.safetensors", {})
    trainer.run()
    return model, trainer, untrained, trainer.save(tmp_path / "trained.safetensors", {})


def _committed(model, path) -> float:
    method = build_method("eagle", model, None, draft_head=str(path), top_k=4, depth=4, max_nodes=16, sized=False)
    return committed_per_step(method, prompts(9, n=6), ar=build_method("ar", model, None))


def test_training_raises_acceptance(tmp_path):
    """A few seconds of training on the tiny model's own outputs beat the untrained head."""
    model, trainer, untrained, trained = _train_tiny_eagle(tmp_path)
    assert trainer.history.evals[-1]["top1"][0] > trainer.history.evals[0]["top1"][0] - 1e-9
    before, after = _committed(model, untrained), _committed(model, trained)
    assert after > before + 0.3, (before, after)
    meta = load_head(trained).meta
    assert meta["vocab"] == TINY_VOCAB and meta["train_samples"] > 0


def test_resumed_training_continues_from_its_checkpoint(tmp_path):
    model = tiny_llama(seed=5)
    rng = random.Random(1)
    samples = [Sample([rng.randrange(TINY_VOCAB) for _ in range(30)], 5, "tiny", torch.randn(29, 64))
               for _ in range(12)]
    cfg = TrainConfig(epochs=2, batch_pairs=64, vocab=0, unroll=1, checkpoint_every=1, eval_depths=1)
    first = EagleTrainer(model, samples, tmp_path, cfg, progress=False)
    first.run()
    again = EagleTrainer(model, samples, tmp_path, cfg, progress=False)
    again.run()  # everything is done: nothing more happens
    assert again.step == first.step and len(again.history.steps) == first.step
    other = EagleTrainer(model, samples, tmp_path, TrainConfig(epochs=3, batch_pairs=64, vocab=0), progress=False)
    with pytest.raises(ValueError, match="other training settings"):
        other.run()


def test_head_files_are_checked(tmp_path):
    small, other = tiny_llama(), tiny_gemma3()
    path = random_head(small, tmp_path / "h.safetensors", trimmed=False)
    with pytest.raises(SpeculumError, match="does not exist"):
        build_method("eagle", small, None, draft_head=str(tmp_path / "missing.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a head")
    with pytest.raises(SpeculumError, match="not a speculum draft head"):
        build_method("eagle", small, None, draft_head=str(bad))
    wide = tiny_llama(vocab=TINY_VOCAB * 2)
    with pytest.raises(SpeculumError, match="vocabulary"):
        build_method("eagle", wide, None, draft_head=str(path))
    with pytest.raises(SpeculumError, match="ships none"):
        build_method("eagle", other, None)
    assert json.loads(json.dumps(load_head(path).meta)) == {"vocab": TINY_VOCAB}


def test_wrong_hidden_size_is_refused(tmp_path):
    model = tiny_llama()
    torch.manual_seed(0)
    cfg = EagleConfig(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    path = save_head(tmp_path / "h.safetensors", "eagle", EagleHead(cfg), None, {"vocab": TINY_VOCAB})
    with pytest.raises(SpeculumError, match="hidden size"):
        build_method("eagle", model, None, draft_head=str(path))


def test_auto_with_an_eagle_arm_equals_ar(tiny_model, tmp_path):
    """``auto`` with the learned arm (given a head) stays lossless; its eagle arm keeps reading hidden
    states on the steps other arms draft."""
    path = random_head(tiny_model, tmp_path / "h.safetensors")
    auto = build_method("auto", tiny_model, None, draft_head=str(path), sized=False)
    assert "eagle" in auto.engine.drafter.arms
    ar = build_method("ar", tiny_model, None)
    chosen = set()
    for p in prompts(4, n=8):
        assert auto.run(p, 40).tokens == ar.run(p, 40).tokens
        chosen.update(auto.engine.drafter.chosen)
    assert "eagle" in chosen


def test_auto_does_not_build_a_retired_arm(tiny_model, tmp_path):
    """An arm that ``auto`` retired on this model and machine (recorded under the calibration key) is
    not built again."""
    from speculum.drafters.arm_memory import ArmMemory, arm_name

    path = random_head(tiny_model, tmp_path / "h.safetensors")
    memory = ArmMemory.for_key("test-retired")
    memory.retire(arm_name("eagle", path))
    auto = build_method("auto", tiny_model, None, draft_head=str(path), sized=False, memory_key="test-retired")
    assert "eagle" not in auto.engine.drafter.arms and not auto.engine.drafter.hidden_layers


def test_eagle_on_the_hf_runner(tmp_path):
    """Hidden states from transformers' own modules feed the head just as well."""
    from speculum.runners import HFRunner

    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors", trimmed=True)
    runner = HFRunner(model)
    ar = Engine(runner, EagleDrafter(model, path, top_k=1, depth=1, max_nodes=0), eos_token_ids=[])
    eagle = Engine(runner, EagleDrafter(model, path, top_k=4, depth=4, max_nodes=16), eos_token_ids=[])
    for p in prompts(6):
        assert eagle.generate(p, 40).tokens == ar.generate(p, 40).tokens


def test_eagle_runs_in_bfloat16(tmp_path):
    """The head and the target's tables run in the target's dtype (output equality is float32's)."""
    model = tiny_llama().to(torch.bfloat16)
    path = random_head(model, tmp_path / "h.safetensors", trimmed=True)
    out = build_method("eagle", model, None, draft_head=str(path), sized=False).run(prompts(7)[0], 24)
    sampled = build_method("eagle", model, None, draft_head=str(path), sized=False).run(
        prompts(7)[1], 24, PARAMS, seed=3)
    assert len(out.tokens) == 24 and len(sampled.tokens) == 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_step_computes_the_trained_function(dtype):
    """The fused (and, in bfloat16, prepacked) drafting path equals the training forward, so the
    head drafts with what it learned: causal pairs fed in two parts against one teacher-forced pass."""
    from speculum.heads import HeadCache

    torch.manual_seed(0)
    cfg = EagleConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    head = EagleHead(cfg).to(dtype).eval()
    feats, embeds = torch.randn(1, 11, 64, dtype=dtype), torch.randn(1, 11, 64, dtype=dtype)
    with torch.no_grad():
        want = head(feats, embeds)[0]
        head.freeze()
        cache = HeadCache(cfg, 4, dtype, torch.device("cpu"))
        parts = []
        for lo, hi in ((0, 6), (6, 11)):
            n = hi - lo
            visible = torch.ones(n, hi, dtype=torch.bool)
            visible[:, lo:] = torch.ones(n, n, dtype=torch.bool).tril()
            cache.reserve(hi)
            parts.append(head.step(feats[0, lo:hi], embeds[0, lo:hi], torch.arange(lo, hi), cache, visible))
            cache.commit()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(torch.cat(parts), want, rtol=tol, atol=tol)


def test_catching_up_in_pieces_drafts_the_same(monkeypatch, tmp_path):
    """A long prompt's pairs go through the head in pieces; the drafts do not change."""
    import speculum.drafters.eagle as eagle_module

    model = tiny_llama()
    path = random_head(model, tmp_path / "h.safetensors")
    p = prompts(8, n=1)[0] + prompts(9, n=1)[0] + prompts(10, n=1)[0]
    whole = build_method("eagle", model, None, draft_head=str(path), sized=False).run(p, 30)
    monkeypatch.setattr(eagle_module, "CATCH_UP_CHUNK", 5)
    pieces = build_method("eagle", model, None, draft_head=str(path), sized=False).run(p, 30)
    assert pieces.tokens == whole.tokens
    assert [s.accepted for s in pieces.steps] == [s.accepted for s in whole.steps]


@pytest.mark.parametrize("make, layers", [(tiny_llama, (0, 1)), (tiny_gemma3, (1, 2, 3))], ids=["llama", "gemma3"])
def test_fused_eagle_equals_ar(make, layers, tmp_path):
    """EAGLE-3's fused low/middle/high features: the drafter reads those layers and stays lossless."""
    model = make()
    path = random_head(model, tmp_path / "h.safetensors", trimmed=True, fuse_layers=layers)
    eagle = build_method("eagle", model, None, draft_head=str(path), sized=False, top_k=4, depth=4, max_nodes=16)
    assert eagle.engine.drafter.hidden_layers == layers
    ar = build_method("ar", model, None)
    for p in prompts(11):
        assert eagle.run(p, 40).tokens == ar.run(p, 40).tokens


def test_fused_training_raises_acceptance(tmp_path):
    """The same with EAGLE-3's fused features (both tiny layers)."""
    model, _, untrained, trained = _train_tiny_eagle(tmp_path, fuse_layers=(1, 2))
    before, after = _committed(model, untrained), _committed(model, trained)
    assert after > before + 0.3, (before, after)


def test_eagle_fullvocab_is_lossless(tmp_path):
    """``eagle_fullvocab``: a head trained with a trimmed LM head drafting through the whole one stays
    lossless."""
    model = tiny_gemma3()
    path = random_head(model, tmp_path / "h.safetensors", trimmed=True)
    full = build_method("eagle_fullvocab", model, None, draft_head=str(path), sized=False)
    assert full.engine.drafter.tables.vocab is None
    ar = build_method("ar", model, None)
    for p in prompts(12):
        assert full.run(p, 40).tokens == ar.run(p, 40).tokens


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("trimmed", [False, True], ids=["full_vocab", "trimmed_vocab"])
def test_device_tree_equals_ar(make, trimmed, tmp_path):
    """The tree grown on the device in fixed shapes (:mod:`speculum.drafters.device_tree`, CUDA's
    default, run eagerly here) keeps ``ar``'s output, an end token among the drafts included; its
    head cache and growth are kept across requests."""
    model = make()
    path = random_head(model, tmp_path / "h.safetensors", trimmed, scale=8.0)
    runner = NativeRunner(model)
    drafter = EagleDrafter(model, path, top_k=4, depth=4, max_nodes=24, device_tree=True)
    for eos in ([], [7]):
        ar = Engine(runner, EagleDrafter(model, path, top_k=1, depth=1, max_nodes=0), eos_token_ids=eos)
        eagle = Engine(runner, drafter, eos_token_ids=eos)
        drafted = 0
        for p in prompts(3, n=2):
            got = eagle.generate(p, 40)
            assert got.tokens == ar.generate(p, 40).tokens
            drafted += sum(s.drafted for s in got.steps)
        assert drafted > 0
    assert drafter._device is not None and drafter._device.capture is False


def test_fixed_shape_step_computes_the_drafting_step():
    """``step_static`` (fixed shapes, a masked bucket of the cache) equals ``step`` on the same pairs."""
    from speculum.heads import HeadCache

    torch.manual_seed(0)
    cfg = EagleConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    head = EagleHead(cfg).eval().freeze()
    feats, embeds = torch.randn(9, 64), torch.randn(9, 64)
    with torch.no_grad():
        cache = HeadCache(cfg, 32, torch.float32, torch.device("cpu"))
        head.step(feats[:6], embeds[:6], torch.arange(6), cache, torch.ones(6, 6, dtype=torch.bool).tril())
        cache.commit()
        visible = torch.tensor([[1, 0, 1], [0, 1, 1], [0, 0, 1]], dtype=torch.bool)
        want = head.step(feats[6:], embeds[6:], torch.tensor([6, 7, 7]), cache,
                         torch.cat([torch.ones(3, 6, dtype=torch.bool), visible], 1))
        kv = cache.kv[0].clone()  # [2, H_kv, C, d]
        kv[0, :, 6:], kv[1, :, 6:] = 5.0, -5.0  # stale entries where the rows are written
        mask = torch.zeros(3, 16, dtype=torch.bool)
        mask[:, :6] = True
        mask[:, 6:9] = visible
        got = head.step_static(feats[6:], embeds[6:], torch.tensor([6, 7, 7]), kv,
                               torch.tensor([6, 7, 8]), mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tree_graphs_equal_ar(tmp_path):
    """On a GPU the device growth replays captured CUDA graphs, and the output is still ``ar``'s."""
    model = tiny_llama().cuda()
    path = random_head(model, tmp_path / "h.safetensors", True, scale=8.0)
    runner = NativeRunner(model)
    drafter = EagleDrafter(model, path, top_k=4, depth=4, max_nodes=24)
    ar = Engine(runner, EagleDrafter(model, path, top_k=1, depth=1, max_nodes=0), eos_token_ids=[])
    eagle = Engine(runner, drafter, eos_token_ids=[])
    for p in prompts(3, n=2):
        assert eagle.generate(p, 40).tokens == ar.generate(p, 40).tokens
    assert drafter._device.capture and drafter._device.graphs
