"""The training loop every head kind shares: data split, draft vocabulary, optimiser and schedule,
checkpoints to resume from, held-out top-1 accuracy per draft depth, the head file and the report.

A kind (:mod:`speculum.train.eagle`, :mod:`speculum.train.medusa`, ...) subclasses
:class:`HeadTrainer` with three methods: ``build_head`` (the module), ``make_source`` (its batches:
an object with ``epoch() -> [batch index lists]`` and ``collate(indices) -> batch``) and ``losses``
(a batch's loss and, per draft depth, ``{"acc", "n", ...}``).

With a trimmed draft vocabulary (the ``vocab`` most frequent response tokens: FR-Spec / VocabTrim)
the cross-entropy runs over those rows of the LM head only; a target token outside them is not
scored (the head can never draft it).
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
from torch import nn

from ..figures import save, subplots
from ..heads import TargetTables, save_head
from ..models import cpu_runs_bfloat16
from ..weights import model_device
from .distill import Sample


@dataclass
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_pairs: int = 4096  # training positions (tokens) per optimiser step
    max_len: int = 1024  # longest sequence trained on (longer ones are cut)
    token_weight: float = 0.1  # eagle: cross-entropy weight beside the feature loss
    noise: float = 0.2  # eagle: uniform feature noise, +- noise / 2 times the features' spread
    unroll: int = 2  # eagle: passes with the head's own predicted features
    fuse_layers: tuple[int, ...] = ()  # eagle: EAGLE-3's fused input layers (empty: the final feature)
    layout: str = "speculum"  # eagle: the head's layout (heads.eagle.LAYOUTS; "eagle1" exports to vLLM)
    vocab: int = 8192  # draft vocabulary size (0: the whole vocabulary)
    val_share: float = 0.05
    checkpoint_every: int = 50  # optimiser steps
    eval_depths: int = 4
    seed: int = 0
    num_heads: int = 4  # medusa / hydra / clover: heads; ppd: prompt tokens (draft depths)
    exit_layer: int = 2  # kangaroo: the target layers the draft runs
    ensemble: int = 1  # ppd: embeddings per prompt position


@dataclass
class History:
    steps: list[dict] = field(default_factory=list)  # per optimiser step: loss, per-kind parts, acc
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


class SequenceBatches:
    """Shuffled, length-sorted batches of whole sequences, about ``batch_pairs`` positions each.

    An item is a tuple of tensors along one sequence's ``n`` positions (a field may run one longer,
    ``[n + 1, ...]``); its last field is the bool mask ``[n]`` of scored positions (items with none
    are dropped). :meth:`collate` pads every field to the batch's longest (floats as float32)."""

    def __init__(self, items: list[tuple[torch.Tensor, ...] | None], batch_pairs: int, rng: random.Random):
        self.items = [it for it in items if it is not None and it[-1].any()]
        self.batch_pairs, self.rng = batch_pairs, rng

    def epoch(self) -> list[list[int]]:
        order = sorted(range(len(self.items)), key=lambda i: (self.items[i][-1].shape[0], self.rng.random()))
        batches, cur, longest = [], [], 0
        for i in order:
            n = self.items[i][-1].shape[0]
            if cur and max(longest, n) * (len(cur) + 1) > self.batch_pairs:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
        self.rng.shuffle(batches)
        return batches

    def collate(self, idx: list[int]) -> tuple[torch.Tensor, ...]:
        """Every field padded (with zeros) to ``[B, longest, ...]``."""
        items = [self.items[i] for i in idx]
        out = []
        for j, first in enumerate(items[0]):
            longest = max(it[j].shape[0] for it in items)
            dtype = torch.float32 if first.is_floating_point() else first.dtype
            field_ = torch.zeros(len(items), longest, *first.shape[1:], dtype=dtype)
            for b, it in enumerate(items):
                field_[b, :it[j].shape[0]] = it[j]
            out.append(field_)
        return tuple(out)


class HeadTrainer:
    """Trains one head; :meth:`run` resumes from ``out/checkpoint.pt`` when it exists."""

    kind = ""

    def __init__(self, model, samples: list[Sample], out: Path, cfg: TrainConfig, progress: bool = True):
        self.cfg, self.out, self.progress = cfg, Path(out), progress
        self.out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(cfg.seed)
        samples = list(samples)
        rng.shuffle(samples)
        n_val = max(1, int(len(samples) * cfg.val_share)) if len(samples) > 1 else 0
        self.val, self.train = samples[:n_val], samples[n_val:]
        self.width = width = model.get_output_embeddings().weight.shape[0]
        self.vocab, self.coverage = draft_vocab(self.train, cfg.vocab, width)
        self.tables = TargetTables.of(model, self.vocab, torch.float32)
        # train where the model is (a GPU, where there is one; a quantized model's meta tensors aside)
        self.device = model_device(model)
        self.bf16_logits = self.device.type == "cuda" or cpu_runs_bfloat16()
        # index of each token in the draft vocabulary (-1 outside it)
        self.slot = torch.arange(width)
        if self.vocab is not None:
            self.slot = torch.full((width,), -1, dtype=torch.int64)
            self.slot[self.vocab] = torch.arange(len(self.vocab))
        self.slot = self.slot.to(self.device)
        torch.manual_seed(cfg.seed)
        self.head = self.build_head(model).to(self.device)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.95))
        self.rng = rng
        self.batches = self.make_source(self.train, rng)
        self.val_batches = self.make_source(self.val, random.Random(cfg.seed + 1))
        self.history = History()
        self.epoch, self.step_in_epoch, self.step = 0, 0, 0

    # -- what a kind provides ----------------------------------------------------------------------
    def build_head(self, model) -> nn.Module:
        raise NotImplementedError

    def make_source(self, samples: list[Sample], rng: random.Random):
        raise NotImplementedError

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        """The loss to minimise and, per draft depth, ``{"acc": top-1, "n": scored tokens, ...}``."""
        raise NotImplementedError

    # -- shared pieces -----------------------------------------------------------------------------
    def on_device(self, batch):
        """A collated batch's tensors on the training device (other values as they are)."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, list | tuple):
            return type(batch)(self.on_device(x) for x in batch)
        return batch

    def scored_logits(self, pred: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict:
        """Cross-entropy and top-1 accuracy of predicted features ``pred [..., D]`` against token ids
        ``labels [...]`` where ``mask [...]`` holds and the label lies in the draft vocabulary."""
        slot = self.slot[labels.clamp(min=0)]
        scored = mask & (slot >= 0)
        if not scored.any():
            return {"loss": pred.new_zeros(()), "acc": 0.0, "n": int(mask.sum())}
        # the LM-head product dominates a head's training: bfloat16 where the hardware runs it
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_logits):
            logits = self.tables.logits(pred[scored])
        logits = logits.float()
        target = slot[scored]
        return {"loss": nn.functional.cross_entropy(logits, target),
                "acc": (logits.argmax(-1) == target).float().mean().item(), "n": int(mask.sum())}

    # -- the loop ----------------------------------------------------------------------------------
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
        bar = tqdm(total=total, initial=self.step, desc=f"training {self.kind}", unit="step",
                   disable=not self.progress)
        while self.epoch < self.cfg.epochs:
            self.rng.seed(self.cfg.seed * 1000 + self.epoch)
            batches = self.batches.epoch()
            self.head.train()
            for b in range(self.step_in_epoch, len(batches)):
                batch = self.on_device(self.batches.collate(batches[b]))
                for g in self.opt.param_groups:
                    g["lr"] = self._lr(total)
                loss, stats = self.losses(batch, train=True)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
                self.opt.step()
                self.step += 1
                self.step_in_epoch = b + 1
                parts = {k: v for k, v in stats[0].items() if k not in ("n",)}
                self.history.steps.append({"step": self.step, "epoch": self.epoch, "loss": loss.item(), **parts,
                                           "time": time.time()})
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
            _, stats = self.losses(self.on_device(self.val_batches.collate(idx)), train=False)
            for k, st in enumerate(stats[:self.cfg.eval_depths]):
                hits[k] += st["acc"] * st["n"]
                count[k] += st["n"]
        self.head.train()
        return [h / c if c else 0.0 for h, c in zip(hits, count)]

    # -- checkpoints -------------------------------------------------------------------------------
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
                "train_config": asdict(self.cfg),
                "trained_parameters": sum(p.numel() for p in self.head.parameters())}
        return save_head(path, self.kind, self.head, self.vocab, meta)


def write_report(history: History, out: Path, meta: dict, kind: str = "") -> tuple[Path, Path]:
    """``report.json`` (settings, per-epoch held-out accuracy by depth, loss per step) and
    ``loss.png`` (loss curves and held-out accuracy)."""
    out = Path(out)
    report = {**meta, "evals": history.evals, "steps": history.steps}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    steps = [s["step"] for s in history.steps]
    keys = [k for k in (history.steps[0] if history.steps else {}) if k not in ("step", "epoch", "time", "acc")]
    for key in keys:
        vals = [s[key] for s in history.steps]
        k = max(1, len(vals) // 100)
        smooth = [sum(vals[max(0, i - k):i + 1]) / len(vals[max(0, i - k):i + 1]) for i in range(len(vals))]
        a.plot(steps, smooth, label=key)
    a.set(yscale="log", xlabel="optimiser step", title=f"{kind} training loss (running mean)".strip())
    a.legend()
    for d in range(len(history.evals[0]["top1"]) if history.evals else 0):
        b.plot([e["epoch"] for e in history.evals], [e["top1"][d] for e in history.evals], marker="o",
               label=f"depth {d + 1}")
    b.set(xlabel="epoch", title="held-out top-1 accuracy by draft depth")
    b.legend()
    png = out / "loss.png"
    save(fig, png, dpi=110)
    return out / "report.json", png
