"""End-to-end losslessness on the packaged models in float32 (slow: loads real weights).

Prompts x 64 new tokens on SmolLM2-135M-Instruct (chat template: plain decoding on six prompts,
the model-free speculative methods on three, the model-drafting ones on two) and on Gemma-3-270M
(base, sliding-window layers: every method on one prompt, and prompt lookup and eagle on one past
its 512-token window), to keep the suite's time:
chains (ngram, draft_model) and trees (ngram_tree, suffix, recycling, mix, auto, eagle; sized to
fixed float32 cost curves measured once on each model). Engine
methods run on the native runner (the default for both models); plain decoding on the Hugging Face
runner must give the same tokens.

The losslessness tests assert token identity only: how much a drafter gets accepted depends on the
cost curve its trees are sized to. That every drafter really drafts is checked apart, with trees
sized to a flat cost curve.
"""

import math

import pytest
import torch

from speculum.heads import find_head
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import HFRunner, NativeRunner, runner_for, under_policy
from speculum.tree_sizing import CostModel

pytestmark = pytest.mark.slow

PROMPTS = [
    ("Summarize: The committee met on Monday to review the budget. The budget was approved after a long "
    "discussion about road repairs. Road repairs will start in May and finish in September."),
    "Translate to French: The weather is nice today and the children are playing in the park.",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "What are the three primary colors? Explain briefly.",
    "Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 12
    + "Continue the story.",
]
SPECULATIVE_PROMPTS = [PROMPTS[i] for i in (0, 4, 5)]  # summary, repetition, long context
NEW = 64
SPECULATIVE = ("ngram", "ngram_tree", "suffix", "recycling", "mix", "auto")
LEARNED = ("eagle", "medusa", "hydra", "kangaroo", "ppd")  # heads shipped for both packaged models
SMOLLM2_LEARNED = LEARNED + ("clover",)  # clover's ships for SmolLM2 only
LEARNED_PROMPTS = [PROMPTS[i] for i in (0, 5)]  # summary and long context: where model-drafters run


# Gemma-3-270M's float32 forward cost on this 2-core CPU at 512 cached tokens, rounded from one
# calibration (2026-11-26), and SmolLM2's on one kernel thread (a test worker's) at 64 and 512, from
# two that agreed (2026-11-27): trees are sized to these fixed curves, which spares the suite the
# minute of measuring each (``speculum calibrate`` itself is tested in test_cli)
GEMMA3_F32_COST = CostModel(tokens=[1, 2, 4, 8, 16, 32, 64], contexts=[512],
                            seconds=[[0.060, 0.066, 0.070, 0.090, 0.118, 0.177, 0.282]])
SMOLLM2_F32_COST = CostModel(tokens=[1, 2, 4, 8, 16, 32, 64], contexts=[64, 512],
                             seconds=[[0.047, 0.060, 0.065, 0.076, 0.097, 0.140, 0.231],
                                      [0.048, 0.062, 0.070, 0.083, 0.109, 0.158, 0.266]])


def _check_methods(model, tok, chat, draft=None, cross_check=True, draft_head=None, learned=LEARNED, prompts=PROMPTS,
                   cost_model=None):
    runner = runner_for(model)
    assert isinstance(runner, NativeRunner)
    hf_runner = build_method("ar", model, tok, runner=HFRunner(model))
    names = ["hf", "ar", "hf_pld"] + list(SPECULATIVE) + (["draft_model"] if draft is not None else []) + list(learned)
    # (auto keeps every learned arm here: no memory of arms retired by earlier tests)
    methods = {m: build_method(m, model, tok, draft, tok, runner=runner, draft_head=draft_head, cost_model=cost_model,
                               **({"memory_key": None} if m == "auto" else {}))
               for m in names}
    for prompt in prompts:
        ids = encode_prompt(tok, prompt, chat)
        ref = methods["ar"].run(ids, NEW).tokens
        assert len(ref) > 0
        assert methods["hf"].run(ids, NEW).tokens == ref, "ar differs from transformers' greedy generate"
        if cross_check and prompt in PROMPTS[-3:]:
            assert hf_runner.run(ids, NEW).tokens == ref, "the native runner differs from the HF runner"
        if prompt not in SPECULATIVE_PROMPTS:
            continue
        for name in names[2:]:
            if (name in learned or name == "draft_model") and prompt not in LEARNED_PROMPTS:
                continue  # the model-drafting methods on two of the four (suite time)
            assert methods[name].run(ids, NEW).tokens == ref, f"{name} differs from ar on {prompt[:40]!r}"


def test_smollm2_float32_lossless(smollm2_f32):
    """Every method, the learned ones and ``auto`` with speculum's shipped heads for this model."""
    model, tok = smollm2_f32
    assert all(find_head(model, kind) is not None for kind in SMOLLM2_LEARNED)
    _check_methods(model, tok, chat=True, draft=model,  # self-drafting exercises the draft cache sync
                   learned=SMOLLM2_LEARNED, cost_model=SMOLLM2_F32_COST)


# a forward whose cost does not grow with its size: the sizer keeps every scored node drafted
FLAT_COST = CostModel(tokens=[1, 64], contexts=[64], seconds=[[0.01, 0.01]])


def test_smollm2_every_drafter_drafts(smollm2_f32):
    """On the most repetitive prompt, every speculative method commits well over one token per
    forward, from a fresh start: no calibration curve and no state from earlier requests (one
    prompt, for the suite's time: the lossless tests run the others)."""
    model, tok = smollm2_f32
    runner = runner_for(model)
    prompts = [encode_prompt(tok, prompt, chat=True) for prompt in PROMPTS[-1:]]
    refs = [build_method("ar", model, tok, runner=runner).run(ids, NEW).tokens for ids in prompts]
    for name in SPECULATIVE + SMOLLM2_LEARNED:
        method = build_method(name, model, tok, runner=runner, cost_model=FLAT_COST)
        accepted = 0.0
        for ids, ref in zip(prompts, refs):
            out = method.run(ids, NEW)
            assert out.tokens == ref, name
            accepted += out.mean_accepted / len(prompts)
        assert accepted > 1.1, f"{name}: {accepted:.2f} tokens per step"


def test_gemma3_float32_lossless_past_window(gemma3_f32):
    """Prompt lookup and eagle past the 512-token sliding window, with the shipped heads."""
    model, tok = gemma3_f32
    assert all(find_head(model, kind) is not None for kind in LEARNED)
    assert model.config.sliding_window == 512
    long_prompt = PROMPTS[-1] * 3
    assert len(encode_prompt(tok, long_prompt, chat=False)) > 512 - NEW
    runner = runner_for(model)
    ids = encode_prompt(tok, long_prompt, chat=False)
    ref = build_method("ar", model, tok, runner=runner).run(ids, NEW).tokens
    assert build_method("ar", model, tok, runner=HFRunner(model)).run(ids, NEW).tokens == ref
    # a chain and a learned tree (mix's, medusa's, hydra's and kangaroo's trees, ppd's prompt rows
    # and auto's bandit over them run on SmolLM2 and on tiny Gemma-3 past its window: suite time)
    for name in ("ngram", "eagle"):
        assert build_method(name, model, tok, runner=runner, cost_model=GEMMA3_F32_COST).run(ids, NEW).tokens == ref, name


def test_gemma3_float32_lossless(gemma3_f32):
    """Every method on the repetitive prompt (Gemma's float32 forwards are dear: suite time).
    The HF runner and every learned drafter are checked past the window above; here eagle."""
    model, tok = gemma3_f32
    _check_methods(model, tok, chat=False, cross_check=False, learned=("eagle",), prompts=PROMPTS[4:5],
                   cost_model=GEMMA3_F32_COST)


# the self-drafters (and lookahead); kv_draft's window is shorter than the prompts, so its view really leaves entries out
# name -> (method, options)
SELF_DRAFTS = {"swift": ("swift", {}), "quant_self": ("quant_self", {}), "kv_draft": ("kv_draft", {"window": 48}),
               "kv_draft_snapkv": ("kv_draft", {"policy": "snapkv", "window": 24, "selected": 16, "observe": 8}),
               "kv_draft_quest": ("kv_draft", {"policy": "quest", "window": 16, "pages": 2, "page": 4}),
               "lookahead": ("lookahead", {"adaptive": False})}  # its window's rows always run


def _check_self_drafts(model, tok, prompts, chat, names=tuple(SELF_DRAFTS), new=NEW):
    runner = runner_for(model)
    for ids in (encode_prompt(tok, p, chat) for p in prompts):
        ref = build_method("ar", model, tok, runner=runner).run(ids, new).tokens
        for name in names:
            kind, options = SELF_DRAFTS[name]
            method = build_method(kind, model, tok, runner=runner, cost_model=FLAT_COST, **options)
            out = method.run(ids, new)
            assert out.tokens == ref, name
            assert out.mean_accepted > 1.0, name


def test_smollm2_self_drafts_lossless(smollm2_f32):
    model, tok = smollm2_f32
    _check_self_drafts(model, tok, [PROMPTS[0]], chat=True)


def test_gemma3_self_drafts_lossless_past_window(gemma3_f32):
    model, tok = gemma3_f32
    # kv_draft only, for the suite's time (quant_self past the window: tiny Gemma-3, test_self_draft.py)
    _check_self_drafts(model, tok, [PROMPTS[-1] * 3], chat=False, names=("kv_draft",), new=32)


def test_hf_assisted_drafts_across_tokenizers(smollm2_f32, gemma3_f32):
    """transformers' universal assisted decoding: Gemma-3 (another tokenizer) drafts for SmolLM2
    through ``hf_assisted``, and the greedy output equals plain ``hf``'s."""
    model, tok = smollm2_f32
    draft, draft_tok = gemma3_f32
    ids = encode_prompt(tok, PROMPTS[4], chat=True)
    ref = build_method("hf", model, tok).run(ids, 24).tokens
    out = build_method("hf_assisted", model, tok, draft, draft_tok).run(ids, 24)
    assert out.tokens == ref
    assert out.forwards < len(ref)  # the draft's tokens were accepted: fewer target forwards than tokens


def _perplexity(model, context: list[int], segment: list[int]) -> float:
    """exp(mean NLL) of ``segment`` after ``context``: one plain transformers forward, full attention."""
    with torch.no_grad():
        logits = model(torch.tensor([context + segment])).logits[0, len(context) - 1:-1]
    return math.exp(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(segment)).item())


def test_smollm2_streaming_runs_three_contexts(smollm2_f32, monkeypatch):
    """StreamingLLM on a real model: SmolLM2, its context cut to 256 positions so that the test
    takes two minutes (``benchmarks/streaming_long.py`` runs the full 3 x 8192), generates 768
    tokens in one request under ``streaming`` with a 96-token budget. The request ends on its
    length, the cache stays within the budget, no position the model reads reaches the context,
    and the text stays coherent: the last 256 tokens, read fresh by the full model after the 256
    before them, are about as likely as the first 256 (perplexity within 2x) and not a loop."""
    from speculum import SamplingParams
    from speculum.attention import Rotary
    from speculum.drafters import AutoregressiveDrafter
    from speculum.engine import Engine
    from speculum.kv import make_policy

    model, tok = smollm2_f32
    runner = NativeRunner(model)
    runner.max_positions = context = 256
    seen = []
    cos_sin = Rotary.cos_sin
    monkeypatch.setattr(Rotary, "cos_sin", lambda self, pos, dtype: seen.append(int(pos.max())) or cos_sin(self, pos, dtype))
    policy = make_policy("streaming", "96")
    engine = Engine(under_policy(runner, policy), AutoregressiveDrafter(), tok, eos_token_ids=[])
    ids = encode_prompt(tok, "Write a long story about travellers crossing a continent: the towns, the people, "
                        "the weather, the food. Keep going.", chat=True)
    out = engine.generate(ids, 3 * context, SamplingParams(0.8, 0, 0.95), seed=0)
    assert out.finish_reason == "length" and out.new_tokens == 3 * context
    per_entry = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * 64 * 4
    assert out.kv_bytes <= (96 + policy.slack(96) + 1) * per_entry
    assert max(seen) < 96 + policy.slack(96) + 1 < context  # positions live in the cache, not the text
    first, last = out.tokens[:context], out.tokens[-context:]
    ppl_first = _perplexity(model, ids, first)
    ppl_last = _perplexity(model, out.tokens[-2 * context:-context], last)
    assert ppl_last < 2 * ppl_first, (ppl_first, ppl_last)
    assert len(set(last)) > 0.3 * len(last)


# the methods on the default model's own quantized weights (what speculum.load gives by default):
# every drafter family against plain greedy decoding of the same weights
GGUF_METHODS = SPECULATIVE + SMOLLM2_LEARNED + ("swift", "quant_self", "lookahead", "kv_draft")


def _check_gguf(model, tok, prompts, chat, names, new=48, draft=None):
    runner = runner_for(model)
    assert type(runner.decoder.layers[0].o).__name__ == "QuantizedLinear"
    for ids in (encode_prompt(tok, p, chat) for p in prompts):
        ref = build_method("ar", model, tok, runner=runner).run(ids, new).tokens
        assert len(ref) > 0
        for name in names:
            method = build_method(name, model, tok, draft, tok, runner=runner, cost_model=FLAT_COST)
            assert method.run(ids, new).tokens == ref, f"{name} differs from ar on {tok.decode(ids)[-40:]!r}"


def test_smollm2_gguf_lossless(smollm2_gguf):
    """Every drafter on SmolLM2's Q4_1/Q8_0 weights, kept quantized: chains, trees, learned heads,
    self-drafts, a draft model (itself) and ``auto`` give ``ar``'s tokens."""
    model, tok = smollm2_gguf
    _check_gguf(model, tok, [PROMPTS[4]], True, GGUF_METHODS + ("draft_model",), new=40, draft=model)


def test_gemma3_gguf_lossless(gemma3_gguf):
    """Gemma-3's Q4_K_M file (Q4_K, Q6_K, Q5_0 and Q8_0 tensors) past its sliding window."""
    model, tok = gemma3_gguf
    kinds = {qw.source for qw in model.speculum_quant.values()}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= {part for k in kinds for part in k.split("+")}
    _check_gguf(model, tok, [PROMPTS[-1] * 3], False, ("ngram", "mix", "eagle", "auto"), new=32)


# the drafting systems added after the table above: model-free (aded, stand), draft models (bild,
# specdecpp, pearl, draft trees: the target itself as the draft, so every drafted token is its own and rejections
# are left to the tiny models' tests), self-speculation (del, drafting every step) and a head adapting
# online (medusa_online) -> options
NEWER_DRAFTERS = {"aded": {}, "stand": {}, "bild": {}, "specdecpp": {}, "pearl": {"gamma": 3}, "draft_model_tree": {},
                  "del": {"sized": False, "allow_none": False}, "medusa_online": {"sized": False, "every": 2}}


@pytest.mark.filterwarnings("ignore:specdecpp")
def test_gemma3_newer_drafters_lossless(gemma3_f32):
    """Gemma-3-270M (float32) on the repetitive prompt: each of the newer drafters gives ar's tokens
    (SmolLM2's checks are in each drafter's own test file)."""
    model, tok = gemma3_f32
    runner = runner_for(model)
    ids = encode_prompt(tok, PROMPTS[4], chat=False)
    ref = build_method("ar", model, tok, runner=runner).run(ids, 24).tokens
    for name, options in NEWER_DRAFTERS.items():
        method = build_method(name, model, tok, model, tok, runner=runner, cost_model=GEMMA3_F32_COST, **options)
        out = method.run(ids, 24)
        assert out.tokens == ref, name
        assert sum(s.drafted for s in out.steps) > 0, name
