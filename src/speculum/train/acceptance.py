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

Run: ``python -m speculum.train.acceptance --out head.safetensors`` (the packaged SmolLM2 in
float32 as target, its int4 copy as draft: a self-draft with the same tokenizer). Shapes: ``N``
pairs, ``D`` the draft's hidden size, ``T`` a sequence's length, ``V`` the vocabulary.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..drafters.draft_model import DraftModelDrafter
from ..engine import Engine
from ..heads.acceptance import AcceptanceConfig, AcceptanceHead, save_acceptance_head
from ..runners import runner_for
from ..tree import DraftTree


@dataclass
class AcceptancePairs:
    hidden: torch.Tensor  # [N, D] the draft's last hidden state a token is drafted from
    label: torch.Tensor  # [N] float in [0, 1]: accepted (or its expected acceptance)


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
    hs, ys = [], []
    with torch.inference_mode():
        for ids, start in tqdm(sequences, desc="acceptance pairs", unit="seq", disable=not progress):
            tl, _ = all_positions(trunner, ids)
            dl, hidden = all_positions(drunner, ids, (layer,))
            keep = slice(max(start - 1, 0), len(ids) - 1)
            hs.append(hidden[layer][keep].float())
            ys.append(acceptance_labels(tl[keep], dl[keep], temperature))
    return AcceptancePairs(torch.cat(hs), torch.cat(ys))


def weighted_bce(logits: torch.Tensor, label: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """SpecDec++'s loss (mean over ``[N]``): accepted tokens weigh 1, rejected ``reject_weight``."""
    logs = torch.nn.functional.logsigmoid(logits)
    log_not = torch.nn.functional.logsigmoid(-logits)
    return -(label * logs + reject_weight * (1.0 - label) * log_not).mean()


def train_head(pairs: AcceptancePairs, inner: int = 64, reject_weight: float = 6.0, steps: int = 400,
               lr: float = 3e-3, batch: int = 512, seed: int = 0, progress: bool = True) -> tuple[AcceptanceHead, dict]:
    """Fit a head on 90% of ``pairs``; returns it and held-out numbers (loss, and the mean predicted
    and true acceptance)."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(pairs.label), generator=gen)
    cut = max(1, int(0.9 * len(order)))
    train, held = order[:cut], order[cut:] if cut < len(order) else order[:1]
    torch.manual_seed(seed)
    head = AcceptanceHead(AcceptanceConfig(pairs.hidden.shape[-1], inner))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    for _ in tqdm(range(steps), desc="acceptance head", unit="step", disable=not progress):
        pick = train[torch.randint(len(train), (min(batch, len(train)),), generator=gen)]
        loss = weighted_bce(head(pairs.hidden[pick]), pairs.label[pick], reject_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = head.accept_prob(pairs.hidden[held])
        stats = {"held_loss": float(weighted_bce(head(pairs.hidden[held]), pairs.label[held], reject_weight)),
                 "held_pred_mean": float(pred.mean()), "held_label_mean": float(pairs.label[held].mean()),
                 "pairs": len(pairs.label)}
    return head.eval().requires_grad_(False), stats


def continuations(target, draft, prompts: Sequence[list[int]], new: int,
                  progress: bool = True) -> list[tuple[list[int], int]]:
    """``(prompt + the target's greedy continuation of new tokens, len(prompt))`` for each prompt,
    generated speculatively with ``draft`` (the output is the target's)."""
    from tqdm import tqdm

    engine = Engine(runner_for(target), DraftModelDrafter(draft, num_draft=4), eos_token_ids=[])
    out = []
    for ids in tqdm(prompts, desc="target continuations", unit="prompt", disable=not progress):
        out.append((list(ids) + engine.generate(ids, new).tokens, len(ids)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from ..loading import load
    from ..prompts import encode_prompt
    from .prompts import training_prompts

    p = argparse.ArgumentParser(prog="python -m speculum.train.acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="target model (default: the packaged SmolLM2)")
    p.add_argument("--draft", default="int4", help="draft model, or int4/int8: the target's quantized copy")
    p.add_argument("--prompts", type=int, default=48, help="training prompts (default 48)")
    p.add_argument("--new", type=int, default=48, help="target tokens generated per prompt (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy labels (default); > 0: soft labels")
    p.add_argument("--inner", type=int, default=64, help="MLP width; 0: a linear head (default 64)")
    p.add_argument("--reject-weight", type=float, default=6.0, help="weight of rejected tokens (default 6)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="head file to write (.safetensors)")
    args = p.parse_args(argv)
    target, tok = load(args.model, "float32", "cpu", weights="float")
    if args.draft in ("int4", "int8"):
        draft, _ = load(args.model, "float32", "cpu", tokenizer=tok, weights=args.draft)
    else:
        draft, _ = load(args.draft, "float32", "cpu", weights="float")
    texts = [text for _, text in training_prompts(args.prompts, seed=args.seed)]
    prompts = [encode_prompt(tok, t)[-256:] for t in texts]
    random.Random(args.seed).shuffle(prompts)
    sequences = continuations(target, draft, prompts, args.new)
    pairs = collect_pairs(target, draft, sequences, args.temperature)
    head, stats = train_head(pairs, args.inner, args.reject_weight, args.steps, seed=args.seed)
    meta = {"target": args.model, "draft": args.draft, "temperature": args.temperature,
            "reject_weight": args.reject_weight, **stats}
    save_acceptance_head(args.out, head, meta)
    print(f"wrote {args.out}: {stats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
