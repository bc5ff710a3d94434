"""Hydra heads (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding"):
Medusa's heads made to read the tokens drafted before them.

Head ``k`` (``k = 1 .. K``) reads the target's feature ``f_t`` ``[D]`` and the embeddings of the
tokens ``x_{t+1} .. x_{t+k}`` (the root, then the drafted path), and predicts ``x_{t+1+k}``: an input
projection of the concatenation ``[f_t; e(x_{t+1}); ...; e(x_{t+k})]`` (``(k+1) D -> D``, starting as
the identity on ``f_t``), ``layers`` residual SiLU blocks, then the target's frozen LM head. So a
tree's sibling branches get different continuations, which Medusa's heads cannot give.

Departures from the paper: the heads share the target's LM head (optionally trimmed) instead of
owning copies, and Hydra++'s extra decoder layer over the target's features is left out.

Shapes: ``D`` the target's hidden size, ``K`` the number of heads, ``m`` nodes expanded at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runners.packed import fast_linear
from .medusa import MedusaConfig, ResBlock


@dataclass(frozen=True)
class HydraConfig(MedusaConfig):
    """The heads' shape (Medusa's fields), saved beside their weights."""


class HydraHead(nn.Module):
    """Head ``k``: ``[f; e_1 .. e_k]`` ``[..., (k+1) D]`` -> a feature ``[..., D]`` for the LM head."""

    def __init__(self, dim: int, k: int, layers: int):
        super().__init__()
        self.proj = nn.Linear((k + 1) * dim, dim)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, :dim] = torch.eye(dim)
            self.proj.bias.zero_()
        self.blocks = nn.Sequential(*(ResBlock(dim) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.proj(x))


class HydraHeads(nn.Module):
    def __init__(self, config: HydraConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(HydraHead(config.hidden, k + 1, config.layers) for k in range(config.num_heads))

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Training: ``feats [..., D]`` and ``embeds [..., K, D]`` (of ``x_{t+1} .. x_{t+K}``) -> every
        head's output ``[..., K, D]`` (head ``k`` at index ``k - 1``, reading ``embeds[..., :k]``)."""
        outs = []
        for k, head in enumerate(self.heads, start=1):
            outs.append(head(torch.cat((feats, embeds[..., :k, :].flatten(-2)), dim=-1)))
        return torch.stack(outs, dim=-2)

    def freeze(self, quantized: bool = False) -> HydraHeads:
        """Ready for drafting (prepacked products where that applies; ``quantized``: on Q8_0 copies
        through the quantized-weight kernels)."""
        self._fast = [(fast_linear(h.proj.weight, h.proj.bias, quantized),
                       [fast_linear(b.linear.weight, b.linear.bias, quantized) for b in h.blocks]) for h in self.heads]
        return self

    def draft(self, k: int, feat: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Drafting (after :meth:`freeze`): head ``k`` for ``m`` paths: ``feat [D]`` (shared),
        ``embeds [m, k, D]`` -> ``[m, D]``."""
        proj, blocks = self._fast[k - 1]
        m = embeds.shape[0]
        x = proj(torch.cat((feat.expand(m, -1), embeds.flatten(1)), dim=-1))
        for lin in blocks:
            x = x + F.silu(lin(x))
        return x
