"""PPD's prompt tokens (Chen et al. 2024, "Hardware-Aware Parallel Prompt Decoding for
Memory-Efficient Acceleration of LLM Inference"): ``N`` trained input embeddings that, appended
after a token, make the frozen target itself predict the tokens after next.

Prompt token ``i`` (``i = 0 .. N-1``) sits ``i + 1`` positions after its anchor token ``v`` and sees
``v``, everything before it and the earlier prompt tokens of its chain; its output (through the
target's own LM head) predicts the token ``i + 2`` places after ``v`` (the token after ``v``, the
bonus, is the target's own prediction at ``v``). With ensembles (``E > 1``, PPD's EPT), each
prompt position has ``E`` embeddings: member ``j`` of position ``i`` sees member ``j`` of positions
``<= i`` (the ensemble mask) and their logits are averaged.

The only trained parameters are ``embeddings [N * E, D]`` (row ``i * E + j``: member ``j`` of
position ``i``): about 0.001% of a 135M-parameter target for ``N = 3, E = 1``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class PPDConfig:
    """The prompt tokens' shape, saved beside their weights."""

    hidden: int  # D
    num_prompts: int = 3  # N: draft depths
    ensemble: int = 1  # E: embeddings per prompt position

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, config, num_prompts: int = 3, ensemble: int = 1) -> PPDConfig:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(hidden=cfg.hidden_size, num_prompts=num_prompts, ensemble=ensemble)


class PPDPrompts(nn.Module):
    def __init__(self, config: PPDConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Parameter(torch.randn(config.num_prompts * config.ensemble, config.hidden) * 0.02)

    def chain_mask(self, depth: int | None = None) -> np.ndarray:
        """The ensemble mask of one anchor's first ``depth`` positions (default all ``N``): ``[r, r]``
        bool over rows ``i * E + j``, True where ``(i, j)`` sees ``(k, j)``, ``k <= i``."""
        n, e = depth or self.config.num_prompts, self.config.ensemble
        pos = np.repeat(np.arange(n), e)
        member = np.tile(np.arange(e), n)
        return (pos[None, :] <= pos[:, None]) & (member[None, :] == member[:, None])

    def offsets(self, depth: int | None = None) -> list[int]:
        """Each row's position after the anchor (``i + 1`` for every member of position ``i``)."""
        n, e = depth or self.config.num_prompts, self.config.ensemble
        return [i + 1 for i in range(n) for _ in range(e)]

    def combine(self, logits: torch.Tensor) -> torch.Tensor:
        """One anchor's rows' logits ``[n * E, V]`` -> per position ``[n, V]`` (the members' mean)."""
        e = self.config.ensemble
        return logits.view(-1, e, logits.shape[-1]).mean(1) if e > 1 else logits

    def freeze(self, quantized: bool = False) -> PPDPrompts:
        """Ready for drafting (embeddings only: nothing to quantize)."""
        return self
