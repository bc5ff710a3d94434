"""DuoAttention (``duo``): heads split by learned gates, streaming heads' storage really bounded,
the gate-mixing forward that learns the gates, and losslessness of every drafter under the policy.

- The split follows the rule: the highest gates keep everything, as many as the budget allows
  (or ``sparsity``); streaming heads keep and read sinks + the window behind each row.
- The mixing forward is full attention at alpha = 1 and, at alpha = 0, exactly what the policy
  computes with every head streaming (its Λ-shaped prefill and its decoding).
- A few optimisation steps on a tiny model lower the objective; gates are written and read back.
- With a covering budget every drafter equals plain decoding; with a lossy one every drafter
  equals ``ar`` under the policy (its reads depend on the row's position alone), and the bytes fall.
"""

import math

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama
from kv_lossless import ar_tokens, assert_drafters_equal_ar, lookup_prompt

from speculum.attention import Step
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import make_policy
from speculum.kv.duo_attention import DuoGates, retrieval_count, retrieval_heads, shipped_gates
from speculum.runners import PolicyRunner, runner_for, under_policy
from speculum.tree import DraftTree


def _gates(tmp_path, alpha, sinks=2, window=8, name="gates.json"):
    return str(DuoGates(torch.tensor(alpha, dtype=torch.float32), sinks, window, "tiny").save(tmp_path / name))


def _run(model, prompt, policy=None, new=24):
    engine = Engine(under_policy(runner_for(model, "native"), policy), AutoregressiveDrafter(), eos_token_ids=[])
    return engine.generate(prompt, new)


def test_split_follows_the_gates_and_the_budget(tmp_path):
    """The module docstring's example: 2 layers x 2 KV heads, sinks 4, window 16, a 100-token prompt
    and a budget of 50: one head (the highest gate) keeps all 100, the others 0..3 and 84..99; a
    token at position 100 reads the sinks and 85..100 there."""
    alpha = [[0.9, 0.1], [0.4, 0.7]]
    assert retrieval_count(100, 50, 4, 16, 4) == 1
    assert retrieval_count(100, 100, 4, 16, 4) == 4 and retrieval_count(15, 10, 4, 16, 4) == 0
    assert retrieval_heads(torch.tensor(alpha), 2).tolist() == [[True, False], [False, True]]
    model = tiny_llama(layers=2)
    runner = PolicyRunner(runner_for(model, "native"), make_policy(f"duo:gates={_gates(tmp_path, alpha, 4, 16)}", "50"))
    cache = runner.new_cache(128)
    runner.prefill(cache, lookup_prompt(100))
    assert cache.state.retrieval.tolist() == [[True, False], [False, False]]
    full, stream = cache.groups
    assert full.used == 100 and full.kv.shape[1] == 1
    assert stream.pos[: stream.used].tolist() == [0, 1, 2, 3] + list(range(84, 100)) and stream.kv.shape[1] == 3
    vis = stream.visible(Step(torch.tensor([100]), None))  # [1, 20 + 1]
    seen = torch.cat([stream.pos[: stream.used], torch.tensor([100])])[vis[0]]
    assert seen.tolist() == [0, 1, 2, 3] + list(range(85, 101))
    # sparsity, the paper's knob, overrides the budget: 3 of 4 heads stream
    policy = make_policy(f"duo:gates={_gates(tmp_path, alpha)},sparsity=0.75", "100000")
    policy.attach(runner.layout, "")
    assert policy.split(runner.layout, 100).tolist() == [[True, False], [False, False]]


def test_streaming_heads_are_bounded_while_decoding(tmp_path):
    """Every head streaming: the window group stays within sinks + window + slack however long the
    output, and a tree step's rows read what one-token steps read (same tokens under speculation)."""
    model = tiny_llama(layers=2)
    spec = f"duo:gates={_gates(tmp_path, [[0.5, 0.5]] * 2)},sparsity=1"
    out = _run(model, lookup_prompt(40), make_policy(spec), new=120)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
    assert out.kv_bytes <= (2 + 8 + 16 + 1) * per_token


def test_mixing_forward_is_full_at_one_and_the_policys_streaming_at_zero(tmp_path):
    from speculum.train.duo_gates import final_hidden, mixer_for

    model = tiny_llama(layers=2)
    ids = torch.tensor(lookup_prompt(40, seed=3))
    mixer = mixer_for(model, 2, 8)
    with torch.no_grad():
        plain = model.model(input_ids=ids[None]).last_hidden_state[0]
        torch.testing.assert_close(final_hidden(model, ids, mixer), plain, atol=1e-5, rtol=1e-5)
        mixer.alpha.zero_()
        streaming = model.lm_head(final_hidden(model, ids, mixer)[-1:])
    # the policy with every head streaming: prefill the first 39 tokens (Λ-shaped), decode the 40th
    runner = PolicyRunner(runner_for(model, "native"), make_policy(f"duo:gates={_gates(tmp_path, [[1, 1]] * 2)},sparsity=1"))
    cache = runner.new_cache(64)
    runner.prefill(cache, ids[:-1].tolist())
    logits = runner.forward(cache, int(ids[-1]), DraftTree()).logits
    torch.testing.assert_close(logits, streaming, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(streaming, model.lm_head(plain[-1:]), atol=1e-2)  # the window matters here
    # Gemma-3: sliding-window layers keep their own attention and get no gates
    gemma = tiny_gemma3()
    mixer = mixer_for(gemma, 2, 8)
    with torch.no_grad():
        plain = gemma.model(input_ids=ids[None]).last_hidden_state[0]
        torch.testing.assert_close(final_hidden(gemma, ids, mixer), plain, atol=1e-5, rtol=1e-5)
    assert mixer.gated().numel() == 1 and mixer.to_gates("", {}).alpha[:3].isnan().all()


def test_a_few_steps_lower_the_objective(tmp_path):
    import random

    from speculum.train.duo_gates import GateTraining, assemble, train_gates

    model = tiny_llama(layers=2)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(10, 96) for _ in range(n)]
    samples = []
    for _ in range(4):
        keys = [ids(4) for _ in range(2)]
        samples.append(assemble([1], ids(60), [[2] + k for k in keys], [[3], [4]], keys, rng))
    cfg = GateTraining(steps=12, lr=0.05, reg=0.05, sinks=2, window=8)
    run = train_gates(model, samples, cfg, progress=False)
    losses = [h["loss"] for h in run.history]
    assert losses[0] == pytest.approx(cfg.reg)  # gates at 1: the full model, only the L1 term
    assert losses[-1] < losses[0] and run.history[-1]["distill"] > 0
    gates = run.mixer.to_gates("tiny", {"steps": 12})
    back = DuoGates.load(gates.save(tmp_path / "g.json"))
    assert back.alpha.shape == (2, 2) and bool((back.alpha <= 1).all() and (back.alpha >= 0).all())
    assert (back.sinks, back.window, back.model) == (2, 8, "tiny")


@pytest.fixture(scope="module")
def llama6():
    return tiny_llama(layers=6)


def test_covering_budget_equals_plain_decoding(tmp_path, llama6):
    prompt = lookup_prompt(60)
    spec = f"duo:gates={_gates(tmp_path, torch.rand(6, 2, generator=torch.Generator().manual_seed(0)).tolist())}"
    assert_drafters_equal_ar(llama6, spec, "100000", prompt, plain=ar_tokens(llama6, prompt))
    gemma = tiny_gemma3()  # 3 sliding-window layers (window 8), one full layer with one KV head
    spec = f"duo:gates={_gates(tmp_path, [[math.nan]] * 3 + [[0.5]], name='gemma.json')}"
    assert_drafters_equal_ar(gemma, spec, "100000", prompt, plain=ar_tokens(gemma, prompt))


def test_lossy_budget_every_drafter_equals_ar_and_memory_falls(tmp_path, llama6):
    prompt = lookup_prompt(60)
    spec = f"duo:gates={_gates(tmp_path, torch.rand(6, 2, generator=torch.Generator().manual_seed(0)).tolist())}"
    assert_drafters_equal_ar(llama6, spec, "0.5", prompt)  # 4 of 12 heads keep everything
    full, duo = _run(llama6, prompt), _run(llama6, prompt, make_policy(spec, "0.5"))
    assert duo.kv_bytes < 0.6 * full.kv_bytes and duo.tokens != full.tokens
    gemma = tiny_gemma3()
    spec = f"duo:gates={_gates(tmp_path, [[math.nan]] * 3 + [[0.5]], name='gemma.json')}"
    assert_drafters_equal_ar(gemma, spec, "12", prompt)  # the one gated head streams


def test_gates_are_required_and_checked(tmp_path):
    layout = runner_for(tiny_llama(layers=2), "native").layout
    with pytest.raises(SpeculumError, match="train-duo"):
        make_policy("duo").attach(layout, "some-model")
    with pytest.raises(SpeculumError, match="do not fit"):
        make_policy(f"duo:gates={_gates(tmp_path, [[0.5, 0.5]] * 3)}").attach(layout, "")
    for bad in ("duo:gates=/nonexistent.json", f"duo:gates={_gates(tmp_path, [[1, 1]] * 2)},sparsity=2",
                f"duo:gates={_gates(tmp_path, [[1, 1]] * 2)},window=0"):
        with pytest.raises(SpeculumError, match="bad option"):
            make_policy(bad)
    shipped = DuoGates.load(shipped_gates("SmolLM2-135M-Instruct.Q4_1"))
    assert shipped.alpha.shape == (30, 3) and (shipped.sinks, shipped.window) == (64, 256)
    assert shipped.alpha.std() > 0.05  # learned, not left at their start


def test_train_duo_command_line():
    from speculum.cli import build_parser

    args = build_parser().parse_args(["train-duo", "--out", "g.json", "--steps", "5", "--max-length", "900"])
    assert (args.steps, args.max_length, args.sinks, args.window, args.reg) == (5, 900, 64, 256, 0.05)
