"""Training the Kangaroo adapter (:mod:`speculum.heads.kangaroo`) on self-distilled samples
(:mod:`speculum.train.distill`, which keeps the shallow layers' hidden states).

Position ``t`` of a sample reads the shallow state ``h_t`` (the output of layer ``exit_layer``,
the adapter attending the states before it) and is trained to predict the target's final feature
``f_t`` (smooth L1, weight 1) and, through the frozen LM head, the token ``x_{t+1}`` the target
produced (cross-entropy; Kangaroo trains on the target's distribution, which these self-distilled
tokens sample). Only response tokens count. Held-out top-1 accuracy is reported for depth 1 only:
the draft reads its own tokens' true shallow states at every depth, so deeper accuracy differs
only by the drafted prefix, which teacher forcing does not model.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..errors import SpeculumError
from ..heads import KangarooAdapter, KangarooConfig
from .distill import Sample
from .trainer import HeadTrainer, SequenceBatches


def _positions(s: Sample, layer: int, max_len: int):
    """``(states [n, D], feats [n, D], labels [n], mask [n])``: position ``t`` reads ``h_t`` and is
    trained on ``f_t`` and ``labels[t] = x_{t+1}``; ``mask``: the label is a response token."""
    if layer not in s.layers:
        raise SpeculumError(f"the training data has no hidden states of layer {layer} (it keeps "
                            f"{sorted(s.layers)}); make the data again with that layer")
    n = min(s.feats.shape[0], max_len)
    if n < 1:
        return None
    t = torch.arange(n)
    return s.layers[layer][:n], s.feats[:n], torch.tensor(s.ids[1:n + 1]), (t + 1) >= s.prompt_len


class KangarooTrainer(HeadTrainer):
    kind = "kangaroo"

    def build_head(self, model) -> KangarooAdapter:
        adapter = KangarooAdapter(KangarooConfig.for_target(model.config, self.cfg.exit_layer))
        with torch.no_grad():  # start the output norm as the target's final norm
            final = model.model.norm
            w = final.weight.detach().float()
            adapter.out_norm.weight.copy_(1.0 + w if model.config.model_type.startswith("gemma") else w)
        return adapter

    def make_source(self, samples: list[Sample], rng: random.Random) -> SequenceBatches:
        return SequenceBatches([_positions(s, self.cfg.exit_layer, self.cfg.max_len) for s in samples],
                               self.cfg.batch_pairs, rng)

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        states, feats, labels, mask = batch
        pred = self.head(states)
        m = mask.unsqueeze(-1).float()
        fl = (F.smooth_l1_loss(pred, feats, reduction="none") * m).sum() / (m.sum() * pred.shape[-1]).clamp(min=1)
        tok = self.scored_logits(pred, labels, mask)
        return fl + tok["loss"], [{"feature": fl.item(), "token": tok["loss"].item(), "acc": tok["acc"], "n": tok["n"]}]
