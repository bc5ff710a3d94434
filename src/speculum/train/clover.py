"""Training Clover heads (:mod:`speculum.heads.clover`) on self-distilled samples
(:mod:`speculum.train.distill`).

Clover's decoder attends to the context, so a sample trains as a whole sequence (every position
at once, causally): at position ``t`` the heads read the target's features up to ``t`` and, teacher
forced, the true tokens ``x_{t+1} .. x_{t+k}``; head ``k`` is trained to predict ``x_{t+1+k}``
(cross-entropy through the frozen LM head, weighted ``0.8^k`` as Medusa's). The prompt's positions
are context; only labels that are response tokens count. Held-out top-1 accuracy per depth is head
``k``'s.
"""

from __future__ import annotations

import random

import torch

from ..heads.clover import CloverConfig, CloverHeads
from .distill import Sample
from .trainer import HeadTrainer, SequenceBatches


def sequence_item(s: Sample, heads: int, max_len: int):
    """``(feats [n, D], ids [n, K + 1], mask [n, K])`` of a sample's ``n`` positions (cut to
    ``max_len``): ``ids[t] = x_{t+1} .. x_{t+1+K}`` (``-1`` past the end); ``mask[t, k - 1]``: head
    ``k``'s label ``x_{t+1+k}`` is a response token."""
    n = min(s.feats.shape[0], max_len)
    if n < 1:
        return None
    seq = torch.tensor(s.ids + [-1] * (heads + 1))
    t = torch.arange(n)
    ids = seq[t[:, None] + 1 + torch.arange(heads + 1)]  # [n, K + 1]
    label_pos = t[:, None] + 2 + torch.arange(heads)  # [n, K]
    mask = (label_pos >= s.prompt_len) & (ids[:, 1:] >= 0)
    return s.feats[:n].float(), ids, mask


class CloverTrainer(HeadTrainer):
    kind = "clover"

    def build_head(self, model) -> CloverHeads:
        return CloverHeads(CloverConfig.for_target(model.config, self.cfg.num_heads))

    def make_source(self, samples: list[Sample], rng: random.Random) -> SequenceBatches:
        return SequenceBatches([sequence_item(s, self.cfg.num_heads, self.cfg.max_len) for s in samples],
                               self.cfg.batch_pairs, rng)

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        """``feats [B, T, D]``, ``ids [B, T, K + 1]``, ``mask [B, T, K]`` (padding: ids 0, mask False)."""
        feats, ids, mask = batch
        pred = self.head(feats, self.tables.embeds(ids[..., :-1].clamp(min=0)))  # [B, T, K, D]
        total, weights, stats = feats.new_zeros(()), 0.0, []
        for k in range(pred.shape[-2]):
            out = self.scored_logits(pred[..., k, :], ids[..., k + 1], mask[..., k])
            total = total + 0.8 ** k * out["loss"]
            weights += 0.8 ** k
            stats.append({"token": out["loss"].item(), "acc": out["acc"], "n": out["n"]})
        return total / weights, stats
