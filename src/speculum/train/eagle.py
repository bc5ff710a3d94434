"""Training an EAGLE head (:mod:`speculum.heads.eagle`) on self-distilled samples
(:mod:`speculum.train.distill`).

Each sample of ``T`` tokens with features ``f_0 .. f_{F-1}`` gives ``F - 1`` pairs: pair ``t``
reads ``f_t`` and the embedding of ``x_{t+1}`` and is trained to predict ``f_{t+1}`` (smooth L1,
EAGLE's regression loss) and, through the frozen LM head, the token ``x_{t+2}`` (cross-entropy,
weight ``token_weight``; EAGLE uses 0.1). Only pairs whose predicted token lies in the response
count; the prompt's pairs are context. Features get uniform noise (EAGLE's robustness trick).

With ``fuse_layers`` (EAGLE-3), pair ``t``'s input is the head's fusion of several target layers'
states at ``t`` (low, middle, high) instead of ``f_t``; the later passes read the head's own
predictions as before, and the feature target stays ``f_{t+1}``.

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

from ..errors import SpeculumError
from ..heads import EagleConfig, EagleHead
from .distill import Sample
from .trainer import HeadTrainer, History, SequenceBatches, TrainConfig, draft_vocab, write_report

__all__ = ["EagleTrainer", "History", "TrainConfig", "draft_vocab", "write_report"]


def _pairs(s: Sample, max_len: int, fuse_layers: tuple[int, ...] = ()):
    """``(inputs [n, D'], targets [n, D], next ids [n], labels [n], mask [n])`` of a sample's ``n``
    pairs (cut to ``max_len``): pair ``t`` reads ``inputs[t]`` (the feature ``f_t``, or with
    ``fuse_layers`` those layers' states at ``t`` concatenated, EAGLE-3) and ``next[t] = x_{t+1}``,
    predicts ``targets[t] = f_{t+1}`` and ``labels[t] = x_{t+2}``; ``mask``: the label is a response token."""
    f = s.feats[:max_len + 1]
    n = f.shape[0] - 1
    if n < 1:
        return None
    if fuse_layers:
        missing = [i for i in fuse_layers if i not in s.layers]
        if missing:
            raise SpeculumError(f"the training data has no hidden states of layers {missing} (it keeps "
                                f"{sorted(s.layers)}); make the data again with them")
        inputs = torch.cat([s.layers[i][:n] for i in fuse_layers], dim=-1)
    else:
        inputs = f[:n]
    ids = torch.tensor(s.ids[:n + 2])
    t = torch.arange(n)
    return inputs, f[1:], ids[1:n + 1], ids[2:n + 2], (t + 2) >= s.prompt_len


class EagleTrainer(HeadTrainer):
    kind = "eagle"

    def build_head(self, model) -> EagleHead:
        head = EagleHead(EagleConfig.for_target(model.config, self.cfg.fuse_layers, self.cfg.layout))
        states = [_pairs(s, 64, self.cfg.fuse_layers) for s in self.train[:64]]
        spread = torch.cat([head.normalized_states(p[0].float()) for p in states if p is not None]).std().item() \
            if any(p is not None for p in states) else 1.0
        self.noise = self.cfg.noise * spread
        return head

    def make_source(self, samples: list[Sample], rng: random.Random) -> SequenceBatches:
        return SequenceBatches([_pairs(s, self.cfg.max_len, self.cfg.fuse_layers) for s in samples],
                               self.cfg.batch_pairs, rng)

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        """Total loss over the unrolled passes, and per pass ``{feature, token, acc, n}``."""
        inputs, targets, nxt, labels, mask = batch
        inputs = self.head.normalized_states(inputs)
        if train and self.noise:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * self.noise
        inputs = self.head.input_features(inputs)
        embeds = self.tables.embeds(nxt)
        total = targets.new_zeros(())
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
