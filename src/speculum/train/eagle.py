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

Held-out samples measure top-1 accuracy per draft depth: depth ``k`` is the ``k``-th unrolled
pass's argmax against the data's token.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..heads import EagleConfig, EagleHead
from .distill import Sample
from .trainer import HeadTrainer, History, SequenceBatches, TrainConfig, draft_vocab, write_report

__all__ = ["EagleTrainer", "History", "TrainConfig", "draft_vocab", "write_report"]


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


class EagleTrainer(HeadTrainer):
    kind = "eagle"

    def build_head(self, model) -> EagleHead:
        train = self.train
        spread = torch.cat([s.feats[:64].float() for s in train[:64]]).std().item() if train else 1.0
        self.noise = self.cfg.noise * spread
        return EagleHead(EagleConfig.for_target(model.config))

    def make_source(self, samples: list[Sample], rng: random.Random) -> SequenceBatches:
        return SequenceBatches([_pairs(s, self.cfg.max_len) for s in samples], self.cfg.batch_pairs, rng)

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        """Total loss over the unrolled passes, and per pass ``{feature, token, acc, n}``."""
        feats, nxt, labels, mask = batch
        inputs, targets = feats[:, :-1], feats[:, 1:]
        if train and self.noise:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.noise
        embeds = self.tables.embeds(nxt)
        total = feats.new_zeros(())
        stats = []
        passes = max(self.cfg.unroll, self.cfg.eval_depths if not train else 1)
        for k in range(passes):
            pred = self.head(inputs, embeds)
            m = mask.unsqueeze(-1).float()
            fl = (F.smooth_l1_loss(pred, targets, reduction="none") * m).sum() / (m.sum() * pred.shape[-1]).clamp(min=1)
            tok = self.scored_logits(pred, labels, mask)
            if k < self.cfg.unroll:
                total = total + fl + self.cfg.token_weight * tok["loss"]
            stats.append({"feature": fl.item(), "token": tok["loss"].item(), "acc": tok["acc"], "n": tok["n"]})
            # the next pass reads this pass's predictions: pair t sees the predicted f_t
            inputs = torch.cat((inputs[:, :1], pred[:, :-1]), dim=1)
        return total / max(1, self.cfg.unroll), stats
