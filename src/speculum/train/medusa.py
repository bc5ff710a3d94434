"""Training Medusa-1 heads (:mod:`speculum.heads.medusa`) and Hydra heads (:mod:`speculum.heads.hydra`)
on self-distilled samples (:mod:`speculum.train.distill`).

Both learn from single positions: the target's feature ``f_t`` and the tokens after it. Head ``k``
is trained to predict ``x_{t+1+k}`` (cross-entropy through the frozen LM head, weighted ``0.8^k`` as
in Medusa); a Hydra head also reads the true tokens ``x_{t+1} .. x_{t+k}`` (teacher forcing). Only
labels that are response tokens count. Held-out top-1 accuracy per depth is head ``k``'s.
"""

from __future__ import annotations

import random

import torch

from ..heads import HydraConfig, HydraHeads, MedusaConfig, MedusaHeads
from .distill import Sample
from .trainer import HeadTrainer, TrainConfig


class Positions:
    """Every response position of the samples as one table: ``feats [N, D]`` (bfloat16),
    ``ids [N, K + 1]`` (``x_{t+1} .. x_{t+1+K}``, ``-1`` past the end) and ``mask [N, K]`` (head
    ``k``'s label is a response token); batches of ``batch_pairs`` shuffled positions."""

    def __init__(self, samples: list[Sample], cfg: TrainConfig, rng: random.Random):
        k = cfg.num_heads
        feats, ids, mask = [], [], []
        for s in samples:
            n_feat = min(s.feats.shape[0], cfg.max_len)
            first = max(0, s.prompt_len - 2)  # the first position whose head-1 label is a response token
            if first >= n_feat:
                continue
            seq = torch.tensor(s.ids + [-1] * (k + 1))
            t = torch.arange(first, n_feat)
            window = seq[t[:, None] + 1 + torch.arange(k + 1)]  # [n, K + 1]
            label_pos = t[:, None] + 2 + torch.arange(k)  # [n, K] where head k's label sits
            feats.append(s.feats[first:n_feat].to(torch.bfloat16))
            ids.append(window)
            mask.append((label_pos >= s.prompt_len) & (window[:, 1:] >= 0))
        d = samples[0].feats.shape[1] if samples else 1
        self.feats = torch.cat(feats) if feats else torch.zeros(0, d, dtype=torch.bfloat16)
        self.ids = torch.cat(ids) if ids else torch.zeros(0, k + 1, dtype=torch.int64)
        self.mask = torch.cat(mask) if mask else torch.zeros(0, k, dtype=torch.bool)
        self.cfg, self.rng = cfg, rng

    def epoch(self) -> list[torch.Tensor]:
        order = torch.randperm(self.feats.shape[0], generator=torch.Generator().manual_seed(self.rng.randrange(1 << 31)))
        return list(order.split(self.cfg.batch_pairs))

    def collate(self, idx: torch.Tensor):
        """``feats [B, D]`` (float32), ``ids [B, K + 1]``, ``mask [B, K]``."""
        return self.feats[idx].float(), self.ids[idx], self.mask[idx]


class MedusaTrainer(HeadTrainer):
    kind = "medusa"

    def build_head(self, model) -> MedusaHeads:
        return MedusaHeads(MedusaConfig.for_target(model.config, self.cfg.num_heads))

    def make_source(self, samples: list[Sample], rng: random.Random) -> Positions:
        return Positions(samples, self.cfg, rng)

    def predict(self, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every head's output ``[B, K, D]``."""
        return self.head(feats)

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        feats, ids, mask = batch
        pred = self.predict(feats, ids)
        total, weights, stats = feats.new_zeros(()), 0.0, []
        for k in range(pred.shape[1]):
            out = self.scored_logits(pred[:, k], ids[:, k + 1], mask[:, k])
            total = total + 0.8 ** k * out["loss"]
            weights += 0.8 ** k
            stats.append({"token": out["loss"].item(), "acc": out["acc"], "n": out["n"]})
        return total / weights, stats


class HydraTrainer(MedusaTrainer):
    kind = "hydra"

    def build_head(self, model) -> HydraHeads:
        return HydraHeads(HydraConfig.for_target(model.config, self.cfg.num_heads))

    def predict(self, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: head ``k`` reads the true ``x_{t+1} .. x_{t+k}``."""
        return self.head(feats, self.tables.embeds(ids[:, :-1].clamp(min=0)))
