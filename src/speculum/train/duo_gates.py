"""Learning DuoAttention's gates (``speculum train-duo``; the policy is :mod:`speculum.kv.duo_attention`).

Every KV head of every full-attention layer gets a gate ``alpha`` in [0, 1], starting at 1; its
query heads' attention output becomes ``alpha * full + (1 - alpha) * streaming``, where streaming
attention sees only the first ``sinks`` tokens and the ``window`` most recent ones
(:func:`~speculum.attention.sinks_or_window`, the same rule the policy applies). With the model's
weights frozen, the gates minimise

    loss = mean over answer tokens of mean_D (h_mixed - h_full)^2  +  reg * mean |alpha|

on synthetic passkey retrieval (passkeys hidden at several depths of a long text, then asked for
one after another), where ``h`` is the final norm's output (what the LM head reads) and
``h_full`` the unmodified model's. Heads whose streaming version loses the passkeys keep a high
gate; the L1 term pulls the others towards 0. As in the paper's code: AdamW, gates clipped to
[0, 1] before every step, the learning rate warmed up over the first fifth of the steps and
decayed over the last fifth.

The forward runs in float32 with torch autograd on the transformers model (the native decoder's
prepacked matrices have no backward), through an attention function registered with transformers
(:class:`GateMixer` holds the gates; :func:`mixing` switches a model to it for a ``with`` block).
Sliding-window layers (Gemma-3) keep their attention and have no gates.

The haystack is paragraphs of the Python standard library's docstrings (no download), the
passkeys words of the NATO alphabet; samples are longer than sinks + window, so that streaming
heads lose the passkeys hidden early. Each sample's reference hidden states are computed once and
the samples are cycled over the steps.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..attention import sinks_or_window
from ..errors import SpeculumError
from ..kv.duo_attention import DuoGates

ATTENTION_NAME = "speculum_duo_gates"  # the attention function's name in transformers' registry
NATO = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo",
        "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
        "whiskey", "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


@dataclass
class GateTraining:
    """The settings of one run (``speculum train-duo``'s options).

    The paper trains 2000 steps at a learning rate of 0.02 on 1k-32k-token samples on GPUs; the
    defaults here fit a two-core CPU in about ten minutes (a step over 600 tokens of a 135M model,
    forward and backward, takes seconds there): a few dozen steps over short samples, so a larger
    learning rate."""

    steps: int = 24
    samples: int = 8  # distinct passkey samples, cycled over the steps
    min_length: int = 512  # sample lengths in tokens, spread evenly between these
    max_length: int = 640
    passkeys: int = 4  # per sample
    passkey_words: int = 6
    sinks: int = 64  # the streaming pattern (the paper's 64 + 256)
    window: int = 256
    lr: float = 0.1
    reg: float = 0.05  # weight of the L1 term (the paper's lambda), on the gates' mean
    seed: int = 0


@dataclass
class GateSample:
    """One training sequence."""

    ids: torch.Tensor  # [n] token ids
    answer: torch.Tensor  # [n] bool: the passkeys' tokens in the answers (where the loss is taken)


# -- data ------------------------------------------------------------------------------------------

def assemble(intro: list[int], haystack: list[int], needles: list[list[int]], questions: list[list[int]],
             answers: list[list[int]], rng: random.Random) -> GateSample:
    """``intro``, the ``haystack`` with ``needles[i]`` inserted at sorted random depths in [0.1, 0.9],
    then each question followed by its answer (the answers' tokens scored)."""
    depths = sorted(rng.uniform(0.1, 0.9) for _ in needles)
    ids, at = list(intro), 0
    for depth, needle in zip(depths, needles):
        cut = int(depth * len(haystack))
        ids += haystack[at:cut] + needle
        at = cut
    ids += haystack[at:]
    scored = [False] * len(ids)
    for q, a in zip(questions, answers):
        ids += q + a
        scored += [False] * len(q) + [True] * len(a)
    return GateSample(torch.tensor(ids), torch.tensor(scored))


def haystack_tokens(tokenizer, n: int) -> list[int]:
    """About ``n`` tokens of standard-library docstring paragraphs."""
    from .prompts import _passages

    out: list[int] = []
    for _, text in _passages():
        out += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(out) >= n:
            break
    if len(out) < n:
        raise SpeculumError(f"the standard library's docstrings give {len(out)} tokens of haystack, fewer than {n}")
    return out


def passkey_samples(tokenizer, cfg: GateTraining) -> list[GateSample]:
    """``cfg.samples`` passkey-retrieval sequences of ``cfg.min_length .. cfg.max_length`` tokens."""
    rng = random.Random(cfg.seed)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    intro = bos + enc("Below is a long text with passkeys hidden in it. Remember every passkey.\n\n")
    pool = haystack_tokens(tokenizer, 4 * cfg.max_length)
    out = []
    for i in range(cfg.samples):
        target = cfg.min_length + (cfg.max_length - cfg.min_length) * i // max(1, cfg.samples - 1)
        keys = [" ".join(rng.choice(NATO) for _ in range(cfg.passkey_words)) for _ in range(cfg.passkeys)]
        ords = ORDINALS[:cfg.passkeys]
        needles = [enc(f"\n\nThe {o} passkey is: {k}. Remember it.\n\n") for o, k in zip(ords, keys)]
        questions = [enc(f"\nWhat is the {o} passkey?\nThe {o} passkey is:") for o in ords]
        answers = [enc(f" {k}.") for k in keys]
        rest = len(intro) + sum(map(len, needles + questions + answers))
        start = rng.randrange(len(pool) - cfg.max_length)
        out.append(assemble(intro, pool[start:start + max(0, target - rest)], needles, questions, answers, rng))
    return out


# -- the mixed attention ---------------------------------------------------------------------------

class GateMixer(torch.nn.Module):
    """The gates ``alpha [layers, H_kv]`` (a parameter; sliding-window layers' unused) and the
    streaming pattern; passed to the model's forward as ``duo=``."""

    def __init__(self, layers: int, kv_heads: int, sliding: list[bool], sinks: int, window: int):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.ones(layers, kv_heads))
        self.sliding, self.sinks, self.window = sliding, sinks, window
        self._mask: torch.Tensor | None = None

    def streaming_mask(self, n: int, device) -> torch.Tensor:
        """Bool ``[n, n]``: causal, and only the sinks and the window behind each row."""
        if self._mask is None or self._mask.shape[0] != n:
            pos = torch.arange(n, device=device)
            self._mask = sinks_or_window(pos, pos, self.sinks, self.window) & (pos[None, :] <= pos[:, None])
        return self._mask

    def gated(self) -> torch.Tensor:
        """The gates of the full-attention layers, ``[G]``."""
        return self.alpha[[i for i, s in enumerate(self.sliding) if not s]].flatten()

    def clamp_(self) -> None:
        with torch.no_grad():
            self.alpha.clamp_(0, 1)

    def to_gates(self, model_key: str, meta: dict) -> DuoGates:
        alpha = self.alpha.detach().clone().clamp(0, 1)
        alpha[[i for i, s in enumerate(self.sliding) if s]] = math.nan
        return DuoGates(alpha, self.sinks, self.window, model_key, meta)


def mixed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, duo=None,
                    **kwargs):
    """transformers' attention interface: ``query [b, H, n, d]``, ``key, value [b, H_kv, n, d]`` ->
    ``([b, n, H, d], None)``; with ``duo`` (a :class:`GateMixer`) each head mixes full causal and
    streaming attention by its KV head's gate, otherwise (and on sliding-window layers) SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if duo is None or getattr(module, "is_sliding", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None:
        raise SpeculumError("learning DuoAttention's gates does not support attention soft-capping")
    n, group = query.shape[2], query.shape[1] // key.shape[1]
    full = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    stream = F.scaled_dot_product_attention(query, key, value, attn_mask=duo.streaming_mask(n, query.device),
                                            scale=scaling, enable_gqa=True)
    a = duo.alpha[module.layer_idx].repeat_interleave(group)[None, :, None, None].to(query.dtype)  # [1, H, 1, 1]
    return (a * full + (1 - a) * stream).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def mixing(model):
    """Within the block, ``model`` (a transformers causal LM) attends through :func:`mixed_attention`
    (its forward then takes ``duo=GateMixer``); its attention implementation is restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, mixed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # SDPA's masks (sliding-window layers need theirs)
    configs = {id(c): c for c in (model.config, model.model.config)}.values()
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = ATTENTION_NAME
        yield model
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation = impl


def mixer_for(model, sinks: int, window: int) -> GateMixer:
    """Gates at 1 for ``model``'s layers and KV heads."""
    from ..runners.base import layer_types

    cfg = getattr(model.config, "text_config", None) or model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    sliding = [t == "sliding_attention" and getattr(cfg, "sliding_window", None) is not None
               for t in layer_types(cfg)]
    return GateMixer(cfg.num_hidden_layers, heads, sliding, sinks, window)


# -- training --------------------------------------------------------------------------------------

def final_hidden(model, ids: torch.Tensor, mixer: GateMixer | None) -> torch.Tensor:
    """The final norm's output ``[n, D]`` for ``ids [n]`` (mixed attention with ``mixer``)."""
    with mixing(model):
        return model.model(input_ids=ids[None], duo=mixer).last_hidden_state[0]


def lr_factor(step: int, steps: int) -> float:
    """Warm-up over the first fifth of the steps, decay over the last fifth, never under 0.1."""
    fifth = max(1, steps // 5)
    return min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


@dataclass
class GateRun:
    """What :func:`train_gates` returns."""

    mixer: GateMixer
    history: list[dict]  # per step: loss, distill, reg, seconds
    seconds: float


@torch.no_grad()
def split_losses(model, samples: list[GateSample], mixer: GateMixer, sparsity: float = 0.5) -> dict[str, float]:
    """The distillation loss (mean over ``samples``) with the gates made binary as the policy makes
    them: the ``sparsity`` share of gated heads with the lowest gates streaming (``learned``), the
    highest ones instead (``reversed``), and every head streaming (``all_streaming``)."""
    from ..kv.duo_attention import retrieval_heads

    gates = mixer.to_gates("", {}).alpha
    gated = int((~gates.isnan()).sum())
    keep = gated - round(sparsity * gated)
    splits = {"learned": retrieval_heads(gates, keep), "reversed": retrieval_heads(-gates, keep),
              "all_streaming": torch.zeros(gates.shape, dtype=torch.bool)}
    binary = mixer_for(model, mixer.sinks, mixer.window)
    targets = [final_hidden(model, s.ids, None)[s.answer].float() for s in samples]
    out = {}
    for name, split in splits.items():
        binary.alpha.copy_(split.float())
        losses = [(final_hidden(model, s.ids, binary)[s.answer].float() - t).pow(2).mean().item()
                  for s, t in zip(samples, targets)]
        out[name] = round(sum(losses) / len(losses), 5)
    return out


def train_gates(model, samples: list[GateSample], cfg: GateTraining, progress: bool = True) -> GateRun:
    """Learn the gates of ``model`` (float32, frozen) on ``samples`` for ``cfg.steps`` steps."""
    from tqdm import tqdm

    if not samples:
        raise SpeculumError("no training samples")
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    mixer = mixer_for(model, cfg.sinks, cfg.window)
    with torch.no_grad():
        targets = [final_hidden(model, s.ids, None)[s.answer].float()
                   for s in tqdm(samples, desc="duo targets", unit="sample", disable=not progress)]
    opt = torch.optim.AdamW(mixer.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg.steps))
    history = []
    bar = tqdm(range(cfg.steps), desc="duo gates", unit="step", disable=not progress)
    for step in bar:
        sample, target = samples[step % len(samples)], targets[step % len(samples)]
        mixer.clamp_()
        h = final_hidden(model, sample.ids, mixer)[sample.answer].float()
        distill = (h - target).pow(2).mean(-1).mean()
        reg = mixer.gated().abs().mean()
        loss = distill + cfg.reg * reg
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        history.append({"step": step, "loss": loss.item(), "distill": distill.item(), "reg": reg.item(),
                        "tokens": int(sample.ids.shape[0]), "seconds": round(time.time() - t0, 1)})
        bar.set_postfix(distill=f"{distill.item():.4f}", mean_alpha=f"{reg.item():.3f}")
    mixer.clamp_()
    return GateRun(mixer, history, time.time() - t0)


def learn_gates(model_name: str, out: Path, cfg: GateTraining, progress: bool = True) -> dict:
    """``speculum train-duo``: load ``model_name`` in float32, learn its gates, write them to ``out``
    (a gates file for ``--kv-policy duo:gates=OUT``); returns a summary."""
    from ..loading import load
    from ..models import target_key

    if cfg.steps < 1 or cfg.samples < 1 or not 0 < cfg.min_length <= cfg.max_length or cfg.passkeys < 1 \
            or cfg.passkeys > len(ORDINALS) or cfg.passkey_words < 1 or cfg.sinks < 0 or cfg.window < 1:
        raise SpeculumError(f"train-duo needs --steps, --samples, --passkey-words >= 1, --passkeys in 1..{len(ORDINALS)}, "
                            "0 < --min-length <= --max-length, --sinks >= 0 and --window >= 1")
    if cfg.max_length <= cfg.sinks + cfg.window:
        raise SpeculumError(f"train-duo: samples of up to {cfg.max_length} tokens lie inside sinks + window "
                            f"({cfg.sinks} + {cfg.window}): streaming heads would lose nothing")
    model, tok = load(model_name, dtype="float32", weights="float")
    if progress:
        print(f"speculum: learning DuoAttention's gates for {model_name} ({cfg.steps} steps)", file=sys.stderr)
    samples = passkey_samples(tok, cfg)
    run = train_gates(model, samples, cfg, progress)
    last = run.history[-min(10, len(run.history)):]
    held = passkey_samples(tok, replace(cfg, samples=3, seed=cfg.seed + 1))  # not trained on
    meta = {"settings": asdict(cfg), "seconds": round(run.seconds),
            "tokens": [int(s.ids.shape[0]) for s in samples[:1]] + [int(samples[-1].ids.shape[0])],
            "final_distill": round(sum(h["distill"] for h in last) / len(last), 5),
            "distill_at_sparsity_0.5": split_losses(model, held, run.mixer)}
    gates = run.mixer.to_gates(target_key(model), meta)
    path = gates.save(out)
    return {"gates": str(path), "model": gates.model, "seconds": round(run.seconds), **meta}
