"""Training SpecDec++'s acceptance head (:mod:`speculum.heads.acceptance`; Huang, Guo, Wang 2024,
https://arxiv.org/abs/2405.19715) for one pair of target and draft model.

Data: for each training prompt (:func:`~speculum.train.prompts.training_prompts`, never Spec-Bench)
the target's greedy continuation is generated (speculatively, with the draft), then one forward of
each model over prompt + continuation gives, at every continuation position ``t``, the draft's
last hidden state ``h_t [D]`` and both models' next-token distributions. The pair's label is
whether the draft's token would be accepted there: greedy (``temperature=0``), 1 where the draft's
argmax equals the target's, else 0; sampled, the expected acceptance ``sum_x min(p(x), q(x))``
of a token drawn from q (a soft label).

Loss: SpecDec++'s weighted binary cross-entropy,
``-(w_acc * y * log s + w_rej * (1 - y) * log(1 - s))`` with ``s = sigmoid(head(h))``: rejections,
the rarer and costlier mistake to miss, are weighted up (``reject_weight``; accepted tokens 1).

Held out: a tenth of the prompts (whole sequences, so that neighbouring positions do not leak).
On their pairs the script compares the head with the stand-in ``specdecpp`` uses without one (the
draft's probability of its token, calibrated by decile on the training pairs): AUC of the
accept / reject ranking, Brier score, and a replay of the stop rule from every held-out position
along the target's path (tokens accepted and drafted per step, :func:`replay_stops`).

Run: ``python -m speculum.train.acceptance --out head.safetensors`` (the packaged SmolLM2 as target,
with the weights users run it with, GGUF on a CPU; its int4 copy as draft). ``--draft first:24``
drafts with the target's first 24 layers, the draft ``benchmarks/truncated_copy.py --layers 24``
saves (the shipped head's pair). Shapes: ``N`` pairs, ``D`` the draft's hidden size, ``T`` a
sequence's length, ``V`` the vocabulary.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafters.ar import AutoregressiveDrafter
from ..drafters.draft_model import DraftModelDrafter
from ..engine import Engine
from ..heads.acceptance import AcceptanceConfig, AcceptanceHead, draft_fingerprint, save_acceptance_head
from ..runners import runner_for
from ..tree import DraftTree


@dataclass
class AcceptancePairs:
    hidden: torch.Tensor  # [N, D] the draft's last hidden state a token is drafted from
    label: torch.Tensor  # [N] float in [0, 1]: accepted (or its expected acceptance)
    draft_prob: torch.Tensor | None = None  # [N] the draft's probability of its greedy token
    seq: torch.Tensor | None = None  # [N] int64: which sequence a pair comes from (in order within it)

    def subset(self, keep: torch.Tensor) -> AcceptancePairs:
        """The pairs at indices ``keep`` ``[M]``."""
        def pick(t):
            return None if t is None else t[keep]
        return AcceptancePairs(self.hidden[keep], self.label[keep], pick(self.draft_prob), pick(self.seq))


def all_positions(runner, ids: Sequence[int], hidden_layers: Sequence[int] = ()):
    """One forward over ``ids`` ``[T]`` (the first as root, the rest as a chain): logits ``[T, V]``
    (row ``t`` predicts token ``t + 1``) and ``{layer: [T, D]}``."""
    cache = runner.new_cache(len(ids) + 1)
    out = runner.forward(cache, ids[0], DraftTree.chain(list(ids[1:])), hidden_layers)
    return out.logits.float(), out.hidden


def acceptance_labels(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[T]`` labels from both models' logits ``[T, V]`` (see the module docstring)."""
    if temperature <= 0:
        return (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    p = torch.softmax(target_logits / temperature, -1)
    q = torch.softmax(draft_logits / temperature, -1)
    return torch.minimum(p, q).sum(-1).clamp(0.0, 1.0)


def collect_pairs(target, draft, sequences: Sequence[tuple[list[int], int]], temperature: float = 0.0,
                  progress: bool = True) -> AcceptancePairs:
    """Pairs from ``sequences`` of ``(ids, start)``: the positions ``t >= start - 1`` (those that
    predict a continuation token)."""
    from tqdm import tqdm

    trunner, drunner = runner_for(target), runner_for(draft)
    layer = drunner.num_layers
    hs, ys, ps, seq = [], [], [], []
    with torch.inference_mode():
        for n, (ids, start) in enumerate(tqdm(sequences, desc="acceptance pairs", unit="seq", disable=not progress)):
            tl, _ = all_positions(trunner, ids)
            dl, hidden = all_positions(drunner, ids, (layer,))
            keep = slice(max(start - 1, 0), len(ids) - 1)
            hs.append(hidden[layer][keep].float())
            ys.append(acceptance_labels(tl[keep], dl[keep], temperature))
            ps.append(torch.softmax(dl[keep], -1).max(-1).values)
            seq.append(torch.full((len(ys[-1]),), n, dtype=torch.long))
    return AcceptancePairs(torch.cat(hs), torch.cat(ys), torch.cat(ps), torch.cat(seq))


def weighted_bce(logits: torch.Tensor, label: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """SpecDec++'s loss (mean over ``[N]``): accepted tokens weigh 1, rejected ``reject_weight``."""
    logs = torch.nn.functional.logsigmoid(logits)
    log_not = torch.nn.functional.logsigmoid(-logits)
    return -(label * logs + reject_weight * (1.0 - label) * log_not).mean()


def held_out_split(pairs: AcceptancePairs, fraction: float = 0.1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train [N1], held [N2])`` pair indices: ``fraction`` of the sequences held out whole
    (at least one, where there are two or more); without sequence ids, of the pairs."""
    gen = torch.Generator().manual_seed(seed)
    if pairs.seq is None:
        order = torch.randperm(len(pairs.label), generator=gen)
        cut = max(1, int((1 - fraction) * len(order)))
        return order[:cut], order[cut:] if cut < len(order) else order[:1]
    ids = torch.unique(pairs.seq)
    n_held = max(1, round(fraction * len(ids))) if len(ids) > 1 else 0
    held_ids = ids[torch.randperm(len(ids), generator=gen)[:n_held]]
    is_held = torch.isin(pairs.seq, held_ids)
    train = torch.nonzero(~is_held).squeeze(-1)
    held = torch.nonzero(is_held).squeeze(-1) if n_held else train[:1]
    return train, held


def calibrated_draft_prob(train: AcceptancePairs, probs: torch.Tensor) -> torch.Tensor:
    """The head-free stand-in's predicted acceptance for draft probabilities ``probs`` ``[M]``: the
    training pairs' acceptance rate in the same probability decile (with one prior pair at the
    decile's middle), what ``draft_model``'s online calibration converges to."""
    def decile(p):
        return (p * 10).long().clamp(0, 9)

    bins = decile(train.draft_prob)
    rate = torch.tensor([(float(train.label[bins == d].sum()) + (d + 0.5) / 10) / (int((bins == d).sum()) + 1)
                         for d in range(10)])
    return rate[decile(probs)]


def auc(pred: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve of ``pred`` ``[M]`` for hard labels ``label > 0.5``: the chance
    that an accepted pair is predicted above a rejected one (ties count half); nan without both."""
    pos, neg = pred[label > 0.5], pred[label <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    _, inverse, counts = torch.unique(pred, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # average ranks, 1-based
    return float((ranks[label > 0.5].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def replay_stops(pred: torch.Tensor, label: torch.Tensor, seq: torch.Tensor, threshold: float,
                 max_draft: int = 8) -> dict:
    """SpecDec++'s stop rule replayed from every position of each sequence along the target's path
    (greedy labels): a chain starting at pair ``t`` drafts ``t, t+1, ...`` until ``1 - prod(pred)``
    exceeds ``threshold``, ``max_draft`` or the sequence's end; it gains the labels' leading run of
    accepted tokens. A chain that drafts past a rejection is off the target's path there; its
    further predictions are taken from the path's states (an approximation of the wasted drafts).
    Returns the mean tokens per step (accepted + 1) and drafted tokens per step."""
    gained = drafted = steps = 0
    for s in torch.unique(seq):
        p, y = pred[seq == s].tolist(), label[seq == s].tolist()
        for t in range(len(p)):
            survive, run, alive = 1.0, 0, True
            for i in range(t, min(t + max_draft, len(p))):
                drafted += 1
                alive = alive and y[i] > 0.5
                run += alive
                survive *= p[i]
                if 1.0 - survive > threshold:
                    break
            gained += run
            steps += 1
    return {"tokens_per_step": 1 + gained / max(steps, 1), "drafted_per_step": drafted / max(steps, 1)}


def compare_on_held_out(head: AcceptanceHead, train: AcceptancePairs, held: AcceptancePairs,
                        threshold: float = 0.7) -> dict:
    """Held-out numbers of the head and of the calibrated-probability stand-in on the same pairs:
    AUC, Brier score, and :func:`replay_stops` at ``threshold`` (greedy labels)."""
    with torch.no_grad():
        mine = head.accept_prob(held.hidden, held.draft_prob)
    out = {"held_pairs": len(held.label), "held_label_mean": float(held.label.mean()),
           "head_pred_mean": float(mine.mean()), "head_auc": auc(mine, held.label),
           "head_brier": float(((mine - held.label) ** 2).mean())}
    if held.draft_prob is not None and train.draft_prob is not None:
        theirs = calibrated_draft_prob(train, held.draft_prob)
        out.update(standin_auc=auc(theirs, held.label), standin_brier=float(((theirs - held.label) ** 2).mean()))
        if held.seq is not None:
            for name, pred in (("head", mine), ("standin", theirs)):
                for k, v in replay_stops(pred, held.label, held.seq, threshold).items():
                    out[f"{name}_{k}"] = v
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def train_head(pairs: AcceptancePairs, inner: int = 64, reject_weight: float = 6.0, steps: int = 400,
               lr: float = 3e-3, batch: int = 512, seed: int = 0, progress: bool = True,
               threshold: float = 0.7, draft_prob: bool = False) -> tuple[AcceptanceHead, dict]:
    """Fit a head on 90% of ``pairs`` (:func:`held_out_split`); returns it and held-out numbers (loss,
    and :func:`compare_on_held_out`'s comparison with the stand-in)."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    train, held = held_out_split(pairs, 0.1, seed)
    torch.manual_seed(seed)
    head = AcceptanceHead(AcceptanceConfig(pairs.hidden.shape[-1], inner, draft_prob))
    probs = pairs.draft_prob if draft_prob else None
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    for _ in tqdm(range(steps), desc="acceptance head", unit="step", disable=not progress):
        pick = train[torch.randint(len(train), (min(batch, len(train)),), generator=gen)]
        loss = weighted_bce(head(pairs.hidden[pick], None if probs is None else probs[pick]), pairs.label[pick],
                            reject_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head = head.eval().requires_grad_(False)
    with torch.no_grad():
        stats = {"pairs": len(pairs.label), "train_pairs": len(train),
                 "held_loss": round(float(weighted_bce(head(pairs.hidden[held], None if probs is None else probs[held]),
                                                       pairs.label[held], reject_weight)), 4),
                 **compare_on_held_out(head, pairs.subset(train), pairs.subset(held), threshold)}
    return head, stats


def continuations(target, draft, prompts: Sequence[list[int]], new: int,
                  progress: bool = True) -> list[tuple[list[int], int]]:
    """``(prompt + the target's greedy continuation of new tokens, len(prompt))`` for each prompt,
    generated speculatively with ``draft`` (the output is the target's), or plainly with
    ``draft=None`` (for a draft that costs more than the target)."""
    from tqdm import tqdm

    drafter = AutoregressiveDrafter() if draft is None else DraftModelDrafter(draft, num_draft=4)
    engine = Engine(runner_for(target), drafter, eos_token_ids=[])
    out = []
    for ids in tqdm(prompts, desc="target continuations", unit="prompt", disable=not progress):
        out.append((list(ids) + engine.generate(ids, new).tokens, len(ids)))
    return out


def first_layers(model_name: str, layers: int, tokenizer=None):
    """``model_name``'s first ``layers`` decoder layers, then its own final norm and LM head, in
    float32 on the CPU: the draft ``benchmarks/truncated_copy.py --layers N`` saves."""
    from ..errors import SpeculumError
    from ..loading import load

    model, _ = load(model_name, "float32", "cpu", tokenizer=tokenizer, weights="float")
    total = model.config.num_hidden_layers
    if not 1 <= layers < total:
        raise SpeculumError(f"--draft first:N needs N in 1..{total - 1}; got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def load_draft(model_name: str, draft: str, tokenizer):
    """The draft of ``--draft``: ``int4`` / ``int8`` (the target's quantized copy), ``first:N``
    (:func:`first_layers`) or a model name (float32 weights)."""
    from ..loading import load

    if draft in ("int4", "int8"):
        return load(model_name, "float32", "cpu", tokenizer=tokenizer, weights=draft)[0]
    if draft.startswith("first:"):
        return first_layers(model_name, int(draft.removeprefix("first:")), tokenizer)
    return load(draft, "float32", "cpu", weights="float")[0]


def main(argv: Sequence[str] | None = None) -> int:
    from ..loading import load
    from ..models import target_key
    from ..prompts import encode_prompt
    from .prompts import training_prompts

    p = argparse.ArgumentParser(prog="python -m speculum.train.acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="target model (default: the packaged SmolLM2)")
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "float", "int8", "int4"],
                   help="the target's weights (default auto: GGUF kernels for a GGUF file, as users run it)")
    p.add_argument("--draft", default="int4", help="draft model: a model name, int4/int8 (the target's quantized "
                   "copy) or first:N (the target's first N layers; default int4)")
    p.add_argument("--prompts", type=int, default=48, help="training prompts (default 48; a tenth held out)")
    p.add_argument("--new", type=int, default=48, help="target tokens generated per prompt (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy labels (default); > 0: soft labels")
    p.add_argument("--inner", type=int, default=64, help="MLP width; 0: a linear head (default 64)")
    p.add_argument("--draft-prob", action="store_true",
                   help="the head also reads the draft's probability of its token (not in the paper)")
    p.add_argument("--reject-weight", type=float, default=6.0, help="weight of rejected tokens (default 6)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--stop", type=float, default=0.7, help="specdecpp's h for the held-out replay (default 0.7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairs", default=None, help="cache of the collected pairs (.pt): read if it exists, else written")
    p.add_argument("--out", required=True, help="head file to write (.safetensors)")
    args = p.parse_args(argv)
    target, tok = load(args.model, None, "cpu", weights=args.weights)
    draft = load_draft(args.model, args.draft, tok)
    if args.pairs and Path(args.pairs).is_file():
        pairs = AcceptancePairs(**torch.load(args.pairs))
    else:
        texts = [text for _, text in training_prompts(args.prompts, seed=args.seed)]
        prompts = [encode_prompt(tok, t)[-256:] for t in texts]
        random.Random(args.seed).shuffle(prompts)
        sequences = continuations(target, None, prompts, args.new)
        pairs = collect_pairs(target, draft, sequences, args.temperature)
        if args.pairs:
            torch.save(vars(pairs), args.pairs)
    head, stats = train_head(pairs, args.inner, args.reject_weight, args.steps, seed=args.seed, threshold=args.stop,
                             draft_prob=args.draft_prob)
    meta = {"target": target_key(target), "target_weights": getattr(target, "speculum_weights", "float"),
            "draft": args.draft, "draft_fingerprint": draft_fingerprint(draft), "prompts": args.prompts,
            "new": args.new, "temperature": args.temperature, "reject_weight": args.reject_weight,
            "steps": args.steps, "seed": args.seed, **stats}
    save_acceptance_head(args.out, head, meta)
    print(f"wrote {args.out}: {stats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
