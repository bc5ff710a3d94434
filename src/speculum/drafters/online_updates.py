"""Learning a draft head while serving: the replay buffer and the two update rules.

:class:`~speculum.drafters.online_adapt.OnlineAdaptDrafter` fills a :class:`ReplayBuffer` with what
verification computed anyway (the target's feature of a token, the tokens committed after it and the
target's distributions over them) and every few steps moves a float32 master copy of the head
towards the target's distributions (:func:`distill_loss`), with one of two rules:

- :func:`backprop_step`: one optimiser step on the loss's gradient (torch autograd through the
  head's few small layers and the target's frozen, trimmed LM head);
- :func:`zeroth_order_step`: SPSA / MeZO (Malladi et al. 2023, "Fine-Tuning Language Models with Just
  Forward Passes", https://arxiv.org/abs/2305.17333): two forward passes at ``theta +/- eps z``, ``z``
  Gaussian noise drawn from a seed, and a step ``-lr * g * z`` along it, ``g = (L+ - L-) / (2 eps)``
  the directional derivative's estimate. No activations are kept and ``z`` is never stored (it is
  drawn again from its seed), so the update needs no memory beyond the weights.

Shapes: ``B`` buffered positions, ``K`` heads (draft depths), ``D`` the target's hidden size,
``Kv`` the draft vocabulary's size (the head's trimmed LM head), ``r`` the target's top tokens kept
per distribution.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..heads import HydraHeads, TargetTables

# Medusa's weight of head k's loss (0.8^(k-1)), which its training uses too (speculum.train.medusa)
DEPTH_DECAY = 0.8


@dataclass
class Batch:
    """Buffered positions: ``feats [B, D]`` the target's feature of token ``x_j``; ``ids [B, K + 1]``
    the committed ``x_{j+1} .. x_{j+1+K}``; ``cols [B, K, r]`` / ``probs [B, K, r]`` the target's
    top-r distribution over ``x_{j+1+k}`` (draft-vocabulary columns, ``-1`` outside it); ``mask [B, K]``
    which labels the target generated (prompt tokens are not its outputs)."""

    feats: torch.Tensor
    ids: torch.Tensor
    cols: torch.Tensor
    probs: torch.Tensor
    mask: torch.Tensor


class ReplayBuffer:
    """The ``capacity`` most recent positions (older ones drop out); :meth:`sample` draws a batch."""

    def __init__(self, capacity: int, seed: int = 0):
        self.rows: deque[tuple[torch.Tensor, ...]] = deque(maxlen=capacity)
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, feat: torch.Tensor, ids: torch.Tensor, cols: torch.Tensor, probs: torch.Tensor,
            mask: torch.Tensor) -> None:
        """One position (a row of each of :class:`Batch`'s tensors)."""
        self.rows.append((feat, ids, cols, probs, mask))

    def sample(self, size: int) -> Batch:
        """Up to ``size`` positions drawn without replacement (seeded: the same draws every run)."""
        n = len(self.rows)
        pick = torch.randperm(n, generator=self.generator)[:size].tolist() if n > size else range(n)
        rows = [self.rows[i] for i in pick]
        with torch.inference_mode(False):  # (rows recorded in inference mode: normal tensors to learn from)
            return Batch(*(torch.stack(column) for column in zip(*rows, strict=True)))


def head_logits(head: torch.nn.Module, tables: TargetTables, batch: Batch) -> torch.Tensor:
    """Every head's draft logits ``[B, K, Kv]`` at the batch's features (a Hydra head reads the
    committed tokens before its depth, as in its training: teacher forcing)."""
    if isinstance(head, HydraHeads):
        out = head(batch.feats, tables.embeds(batch.ids[:, :-1]))
    else:
        out = head(batch.feats)
    return tables.logits(out).float()


def misses(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B, K]``: the labels the head's top token gets wrong (its draft there would be rejected
    under greedy verification), among those it can draft (the target's top token in its vocabulary)."""
    top = batch.cols[..., 0]
    return batch.mask & (top >= 0) & (logits.argmax(-1) != top)


def distill_loss(logits: torch.Tensor, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
    """Forward KL from the target's top-r distribution (renormalised over the draft vocabulary) to
    the head's, up to the target's entropy: ``sum_k w_k mean_b -sum_r p log q``, over the ``rows [B, K]``
    chosen, ``w_k = 0.8^(k-1)`` normalised over the depths that have rows."""
    logq = torch.log_softmax(logits, -1)  # [B, K, Kv]
    inside = batch.cols >= 0
    p = batch.probs * inside
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    per_label = -(p * logq.gather(-1, batch.cols.clamp_min(0))).sum(-1)  # [B, K]
    rows = rows & inside.any(-1)
    weights = DEPTH_DECAY ** torch.arange(logits.shape[1], dtype=torch.float32)
    total, norm = logits.new_zeros(()), 0.0
    for k in range(logits.shape[1]):
        chosen = rows[:, k]
        if chosen.any():
            total = total + weights[k] * per_label[chosen, k].mean()
            norm += float(weights[k])
    return total / norm if norm else total


# the loss of a head's weights as they stand, on a fixed batch (the update rules' objective)
Objective = Callable[[], torch.Tensor]


def backprop_step(objective: Objective, optimizer: torch.optim.Optimizer) -> float:
    """One optimiser step on ``objective``'s gradient; the loss before it."""
    optimizer.zero_grad(set_to_none=True)
    loss = objective()
    if loss.requires_grad:
        loss.backward()
        optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def zeroth_order_step(objective: Objective, params: list[torch.Tensor], lr: float, eps: float, seed: int) -> float:
    """One SPSA / MeZO step (forward passes only): ``theta -= lr * (L(theta + eps z) - L(theta - eps z))
    / (2 eps) * z``, ``z ~ N(0, I)`` drawn from ``seed`` (again for each use, never stored); the mean
    of the two losses."""
    _perturb(params, seed, eps)
    plus = float(objective())
    _perturb(params, seed, -2 * eps)
    minus = float(objective())
    _perturb(params, seed, eps)  # back to theta
    _perturb(params, seed, -lr * (plus - minus) / (2 * eps))
    return (plus + minus) / 2


def _perturb(params: list[torch.Tensor], seed: int, scale: float) -> None:
    """``theta += scale * z`` with the ``z`` of ``seed`` (the same noise for the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype), alpha=scale)
