"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"), Medusa-1: small heads on the frozen target's last feature.

Head ``k`` (``k = 1 .. K``) reads the target's feature ``f_t`` ``[D]`` (its final-norm hidden state,
from which the LM head predicts ``x_{t+1}``) and predicts the token ``x_{t+1+k}``, ``k`` places
further, with no knowledge of the tokens in between. Each head is ``layers`` residual blocks
``x + SiLU(W x + b)`` (``W`` starts at zero, so an untrained head repeats the target's own next-token
prediction, the paper's initialisation) whose output goes through the target's frozen LM head.

Departure from the paper: the heads share the target's LM head (optionally trimmed to a draft
vocabulary) instead of each owning a trained copy; a vocabulary-sized matrix per head would be
larger than a small target's layers. Published heads (:mod:`~speculum.heads.published`) own theirs
(``vocab``: ``lm_head [K, V, D]``).

Shapes: ``D`` the target's hidden size, ``K`` the number of heads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runners.packed import fast_linear


@dataclass(frozen=True)
class MedusaConfig:
    """The heads' shape, saved beside their weights."""

    hidden: int  # D
    num_heads: int = 4  # K
    layers: int = 1  # residual blocks per head
    vocab: int = 0  # V where every head has an LM head of its own (the paper's); 0: the target's, shared

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, config, num_heads: int = 4) -> MedusaConfig:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(hidden=cfg.hidden_size, num_heads=num_heads)


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` on ``[..., D]``; ``W`` zero at first (the identity)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``K`` heads of ``layers`` residual blocks each; :meth:`forward` returns every head's feature."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(config.hidden) for _ in range(config.layers)))
                                   for _ in range(config.num_heads))
        if config.vocab:
            self.lm_head = nn.Parameter(torch.zeros(config.num_heads, config.vocab, config.hidden))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """``feats [..., D]`` -> ``[..., K, D]``: head ``k``'s output (index ``k - 1``) predicts the
        token ``k + 1`` places after the feature's token."""
        return torch.stack([head(feats) for head in self.heads], dim=-2)

    def freeze(self, quantized: bool = False) -> MedusaHeads:
        """Ready for drafting: the first block of every head in one product (their inputs are equal);
        ``quantized``: the products on Q8_0 copies through the quantized-weight kernels."""
        first = [head[0].linear for head in self.heads]
        self._first = fast_linear(torch.cat([lin.weight for lin in first]), torch.cat([lin.bias for lin in first]),
                                  quantized)
        self._rest = [[fast_linear(block.linear.weight, block.linear.bias, quantized) for block in head[1:]]
                      for head in self.heads]
        return self

    def draft(self, feat: torch.Tensor) -> torch.Tensor:
        """Drafting (after :meth:`freeze`): ``feat [D]`` -> ``[K, D]``, :meth:`forward`'s function."""
        k, d = self.config.num_heads, self.config.hidden
        x = feat[None] + F.silu(self._first(feat[None])).view(k, d)
        rows = []
        for i, rest in enumerate(self._rest):
            h = x[i:i + 1]
            for lin in rest:
                h = h + F.silu(lin(h))
            rows.append(h)
        return torch.cat(rows)

    def draft_logits(self, feat: torch.Tensor, tables) -> torch.Tensor:
        """Drafting: ``feat [D]`` -> every head's logits ``[K, V]``, through its own LM head, or
        the target's (``tables``: :class:`~speculum.heads.TargetTables`, its draft vocabulary)."""
        out = self.draft(feat)
        return torch.bmm(out[:, None], self.lm_head.mT)[:, 0] if self.config.vocab else tables.logits(out)
