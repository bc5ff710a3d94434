"""Training an EAGLE head (:mod:`speculum.heads.eagle`) on self-distilled samples
(:mod:`speculum.train.distill`).

Each sample of ``T`` tokens with features ``f_0 .. f_{F-1}`` gives ``F - 1`` pairs: pair ``t``
reads ``f_t`` and the embedding of ``x_{t+1}`` and is trained to predict ``f_{t+1}`` (smooth L1,
EAGLE's regression loss) and, through the frozen LM head, the token ``x_{t+2}`` (cross-entropy,
weight ``token_weight``; EAGLE uses 0.1). Only pairs whose predicted token lies in the response
count; the prompt's pairs are context. Features get uniform noise (EAGLE's robustness trick).

``unroll > 1`` adds passes in which every pair reads the previous pass's predicted feature in
place of the target's (the error a head meets at draft depth 2, 3, ...; in the spirit of
EAGLE-3's training-time test and HASS), with the same targets.

With a trimmed draft vocabulary (the ``vocab`` most frequent response tokens: FR-Spec / VocabTrim)
the cross-entropy runs over those rows of the LM head only; a target token outside them is not
scored (the head can never draft it).

Held-out samples measure top-1 accuracy per draft depth: depth ``k`` is the ``k``-th unrolled
pass's argmax against the data's token.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..heads import EagleConfig, EagleHead, TargetTables, save_head
from .distill import Sample


@dataclass
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_pairs: int = 4096  # pairs (tokens) per optimiser step
    max_len: int = 1024  # longest sequence trained on (longer ones are cut)
    token_weight: float = 0.1  # cross-entropy weight beside the feature loss
    noise: float = 0.2  # uniform feature noise, +- noise / 2 ... EAGLE's U(-0.1, 0.1) scaled by the features' spread
    unroll: int = 2  # passes with the head's own predicted features
    vocab: int = 8192  # draft vocabulary size (0: the whole vocabulary)
    val_share: float = 0.05
    checkpoint_every: int = 50  # optimiser steps
    eval_depths: int = 4
    seed: int = 0


@dataclass
class History:
    steps: list[dict] = field(default_factory=list)  # per optimiser step: loss, feature loss, token loss, acc
    evals: list[dict] = field(default_factory=list)  # per epoch: held-out top-1 per depth


def draft_vocab(samples: list[Sample], size: int, width: int) -> tuple[torch.Tensor | None, float]:
    """The ``size`` most frequent response tokens (sorted ids) and the share of response tokens they
    cover; ``(None, 1.0)`` for ``size`` 0 or at least the vocabulary."""
    if not size or size >= width:
        return None, 1.0
    counts = Counter(t for s in samples for t in s.ids[s.prompt_len:])
    top = sorted(t for t, _ in counts.most_common(size))
    covered = sum(counts[t] for t in top) / max(1, sum(counts.values()))
    return torch.tensor(top, dtype=torch.int64), covered


def _pairs(s: Sample, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(feats [n+1, D], next ids [n], labels [n], mask [n])`` of a sample's ``n`` pairs (cut to
    ``max_len``): pair ``t`` reads ``feats[t]`` and ``next[t] = x_{t+1}``, predicts ``feats[t+1]`` and
    ``labels[t] = x_{t+2}``; ``mask``: the label is a response token."""
    f = s.feats[:max_len + 1]
    n = f.shape[0] - 1
    if n < 1:
        return None
    ids = torch.tensor(s.ids[:n + 2])
    t = torch.arange(n)
    return f, ids[1:n + 1], ids[2:n + 2], (t + 2) >= s.prompt_len


class Batches:
    """Shuffled, length-sorted batches of whole sequences, about ``batch_pairs`` pairs each."""

    def __init__(self, samples: list[Sample], cfg: TrainConfig, rng: random.Random):
        self.items = [p for p in (_pairs(s, cfg.max_len) for s in samples) if p is not None and p[3].any()]
        self.cfg, self.rng = cfg, rng

    def epoch(self) -> list[list[int]]:
        order = sorted(range(len(self.items)), key=lambda i: (self.items[i][1].shape[0], self.rng.random()))
        batches, cur, longest = [], [], 0
        for i in order:
            n = self.items[i][1].shape[0]
            if cur and max(longest, n) * (len(cur) + 1) > self.cfg.batch_pairs:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
        self.rng.shuffle(batches)
        return batches

    def collate(self, idx: list[int]):
        """Padded ``feats [B, n+1, D]``, ``next [B, n]``, ``labels [B, n]``, ``mask [B, n]``."""
        items = [self.items[i] for i in idx]
        n = max(it[1].shape[0] for it in items)
        d = items[0][0].shape[1]
        feats = torch.zeros(len(items), n + 1, d)
        nxt = torch.zeros(len(items), n, dtype=torch.int64)
        labels = torch.zeros(len(items), n, dtype=torch.int64)
        mask = torch.zeros(len(items), n, dtype=torch.bool)
        for b, (f, x, y, m) in enumerate(items):
            k = x.shape[0]
            feats[b, :k + 1], nxt[b, :k], labels[b, :k], mask[b, :k] = f.float(), x, y, m
        return feats, nxt, labels, mask


class EagleTrainer:
    """Trains one head; :meth:`run` resumes from ``out/checkpoint.pt`` when it exists."""

    def __init__(self, model, samples: list[Sample], out: Path, cfg: TrainConfig, progress: bool = True):
        self.cfg, self.out, self.progress = cfg, Path(out), progress
        self.out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(cfg.seed)
        samples = list(samples)
        rng.shuffle(samples)
        n_val = max(1, int(len(samples) * cfg.val_share)) if len(samples) > 1 else 0
        self.val, self.train = samples[:n_val], samples[n_val:]
        width = model.get_output_embeddings().weight.shape[0]
        self.width = width
        self.vocab, self.coverage = draft_vocab(self.train, cfg.vocab, width)
        self.tables = TargetTables.of(model, self.vocab, torch.float32)
        self.head_config = EagleConfig.for_target(model.config)
        torch.manual_seed(cfg.seed)
        self.head = EagleHead(self.head_config)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.95))
        self.rng = rng
        self.batches = Batches(self.train, cfg, rng)
        self.val_batches = Batches(self.val, cfg, random.Random(cfg.seed + 1))
        self.history = History()
        self.epoch, self.step_in_epoch, self.step = 0, 0, 0
        # index of each token in the draft vocabulary (-1 outside it)
        self.slot = torch.full((width,), -1, dtype=torch.int64)
        if self.vocab is not None:
            self.slot[self.vocab] = torch.arange(len(self.vocab))
        else:
            self.slot = torch.arange(width)
        spread = torch.cat([s.feats[:64].float() for s in self.train[:64]]).std().item() if self.train else 1.0
        self.noise = cfg.noise * spread

    # -- the losses ------------------------------------------------------------------------------
    def losses(self, feats, nxt, labels, mask, noise: bool) -> tuple[torch.Tensor, list[dict]]:
        """Total loss over the unrolled passes, and per pass ``{feature, token, acc, n}``."""
        inputs, targets = feats[:, :-1], feats[:, 1:]
        if noise and self.noise:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.noise
        embeds = self.tables.embeds(nxt)
        slot = self.slot[labels]
        scored = mask & (slot >= 0)
        total = feats.new_zeros(())
        stats = []
        passes = max(self.cfg.unroll, self.cfg.eval_depths if not noise else 1)
        for k in range(passes):
            pred = self.head(inputs, embeds)
            m = mask.unsqueeze(-1).float()
            fl = (F.smooth_l1_loss(pred, targets, reduction="none") * m).sum() / (m.sum() * pred.shape[-1]).clamp(min=1)
            logits = self.tables.logits(pred[scored])
            tl = F.cross_entropy(logits, slot[scored]) if scored.any() else fl.new_zeros(())
            acc = (logits.argmax(-1) == slot[scored]).float().mean().item() if scored.any() else 0.0
            if k < self.cfg.unroll:
                total = total + fl + self.cfg.token_weight * tl
            stats.append({"feature": fl.item(), "token": tl.item(), "acc": acc, "n": int(mask.sum())})
            # the next pass reads this pass's predictions: pair t sees the predicted f_t
            inputs = torch.cat((inputs[:, :1], pred[:, :-1]), dim=1)
        return total / max(1, self.cfg.unroll), stats

    # -- the loop --------------------------------------------------------------------------------
    def _lr(self, total_steps: int) -> float:
        warm = max(1, total_steps // 50)
        if self.step < warm:
            return self.cfg.lr * (self.step + 1) / warm
        frac = (self.step - warm) / max(1, total_steps - warm)
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def run(self) -> dict:
        from tqdm import tqdm

        self._resume()
        per_epoch = len(self.batches.epoch())
        total = per_epoch * self.cfg.epochs
        bar = tqdm(total=total, initial=self.step, desc="training eagle", unit="step", disable=not self.progress)
        while self.epoch < self.cfg.epochs:
            self.rng.seed(self.cfg.seed * 1000 + self.epoch)
            batches = self.batches.epoch()
            self.head.train()
            for b in range(self.step_in_epoch, len(batches)):
                feats, nxt, labels, mask = self.batches.collate(batches[b])
                for g in self.opt.param_groups:
                    g["lr"] = self._lr(total)
                loss, stats = self.losses(feats, nxt, labels, mask, noise=True)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
                self.opt.step()
                self.step += 1
                self.step_in_epoch = b + 1
                self.history.steps.append({"step": self.step, "epoch": self.epoch, "loss": loss.item(),
                                           "feature": stats[0]["feature"], "token": stats[0]["token"],
                                           "acc": stats[0]["acc"], "time": time.time()})
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{stats[0]['acc']:.2f}")
                if self.step % self.cfg.checkpoint_every == 0:
                    self._checkpoint()
            self.epoch += 1
            self.step_in_epoch = 0
            self.history.evals.append({"epoch": self.epoch, "step": self.step, "top1": self.evaluate()})
            self._checkpoint()
        bar.close()
        return self.history.evals[-1] if self.history.evals else {}

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Held-out top-1 accuracy at draft depths ``1 .. eval_depths``."""
        self.head.eval()
        hits = [0.0] * self.cfg.eval_depths
        count = [0] * self.cfg.eval_depths
        for idx in self.val_batches.epoch():
            feats, nxt, labels, mask = self.val_batches.collate(idx)
            _, stats = self.losses(feats, nxt, labels, mask, noise=False)
            for k, st in enumerate(stats[:self.cfg.eval_depths]):
                hits[k] += st["acc"] * st["n"]
                count[k] += st["n"]
        self.head.train()
        return [h / c if c else 0.0 for h, c in zip(hits, count)]

    # -- checkpoints -----------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        path = self.out / "checkpoint.pt"
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "epoch": self.epoch,
                 "step_in_epoch": self.step_in_epoch, "step": self.step, "history": asdict(self.history),
                 "config": asdict(self.cfg)}
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)

    def _resume(self) -> None:
        path = self.out / "checkpoint.pt"
        if not path.exists():
            return
        state = torch.load(path, weights_only=False)
        if state.get("config") != asdict(self.cfg):
            raise ValueError(f"{path} was written with other training settings; remove it or use the same ones")
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.epoch, self.step_in_epoch, self.step = state["epoch"], state["step_in_epoch"], state["step"]
        self.history = History(**state["history"])

    def save(self, path: Path, meta: dict) -> Path:
        meta = {**meta, "vocab": self.width, "draft_vocab": None if self.vocab is None else len(self.vocab),
                "vocab_coverage": round(self.coverage, 4), "train_samples": len(self.train),
                "val_samples": len(self.val), "top1_by_depth": self.history.evals[-1]["top1"] if self.history.evals else None,
                "train_config": asdict(self.cfg)}
        return save_head(path, "eagle", self.head, self.vocab, meta)


def write_report(history: History, out: Path, meta: dict) -> tuple[Path, Path]:
    """``report.json`` (settings, per-epoch held-out accuracy by depth, loss per step) and
    ``loss.png`` (loss curves and held-out accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    report = {**meta, "evals": history.evals, "steps": history.steps}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [s["step"] for s in history.steps]
    for key in ("loss", "feature", "token"):
        vals = [s[key] for s in history.steps]
        k = max(1, len(vals) // 100)
        smooth = [sum(vals[max(0, i - k):i + 1]) / len(vals[max(0, i - k):i + 1]) for i in range(len(vals))]
        a.plot(steps, smooth, label=key)
    a.set_yscale("log")
    a.set_xlabel("optimiser step")
    a.set_title("training loss (running mean)")
    a.legend()
    for d in range(len(history.evals[0]["top1"]) if history.evals else 0):
        b.plot([e["epoch"] for e in history.evals], [e["top1"][d] for e in history.evals], marker="o",
               label=f"depth {d + 1}")
    b.set_xlabel("epoch")
    b.set_title("held-out top-1 accuracy by draft depth")
    b.legend()
    fig.tight_layout()
    png = out / "loss.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return out / "report.json", png
