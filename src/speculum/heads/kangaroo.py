"""The Kangaroo adapter (Liu et al. 2024, "Kangaroo: Lossless Self-Speculative Decoding via Double
Early Exiting"): the draft model is the target's own first ``exit_layer`` layers (a shallow
sub-network, frozen and shared) followed by this small trained adapter and the target's frozen LM
head.

The adapter is the paper's: a norm, one multi-head attention layer over the shallow hidden states
of the sequence so far (its own KV cache), a residual, and a second norm whose output stands in
for the target's final feature. No MLP. It is trained to map the shallow state ``h_t`` (the output
of layer ``exit_layer`` at token ``t``) to the target's final feature ``f_t`` and, through the LM
head, to the token ``x_{t+1}`` the target chose there.

Shapes: ``D`` the target's hidden size, ``H`` / ``H_kv`` / ``d`` the adapter's attention heads and
head dim (the target's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .eagle import AttentionHead, HeadCache, RMSNorm, _rotate, cached_attention


@dataclass(frozen=True)
class KangarooConfig:
    """The adapter's shape, saved beside its weights."""

    hidden: int  # D
    heads: int  # H
    kv_heads: int  # H_kv
    head_dim: int  # d
    exit_layer: int = 2  # the target layers the draft runs (its hidden state numbered as the runners')
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, config, exit_layer: int = 2) -> KangarooConfig:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", heads),
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, exit_layer=exit_layer,
                   rope_theta=float(getattr(cfg, "rope_theta", 10000.0) or 10000.0),
                   eps=float(getattr(cfg, "rms_norm_eps", 1e-6)))


class KangarooAdapter(AttentionHead):
    """norm -> attention -> residual -> norm: shallow states ``[.., D]`` -> predicted features ``[.., D]``."""

    def __init__(self, config: KangarooConfig):
        super().__init__(config)
        self.out_norm = RMSNorm(config.hidden, config.eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """Training: shallow states ``[B, T, D]`` (token ``t`` at position ``t``, causal) -> ``[B, T, D]``."""
        c = self.config
        lead = states.shape[:-1]
        x = self.input_norm(states)
        q = self.q(x).view(*lead, c.heads, c.head_dim).transpose(-2, -3)
        k = self.k(x).view(*lead, c.kv_heads, c.head_dim).transpose(-2, -3)
        v = self.v(x).view(*lead, c.kv_heads, c.head_dim).transpose(-2, -3)
        cos, sin = self.rope(torch.arange(states.shape[-2], device=states.device), x.dtype)
        attn = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True,
                                              enable_gqa=True)
        return self.out_norm(states + self.o(attn.transpose(-2, -3).flatten(-2)))

    def freeze(self, quantized: bool = False) -> KangarooAdapter:
        """Ready for drafting: q/k/v fused into one product (prepacked where that applies; ``quantized``:
        on Q8_0 copies through the quantized-weight kernels)."""
        self._fast = {"qkv": self.fast(self.q.weight, self.k.weight, self.v.weight, quantized=quantized),
                      "o": self.fast(self.o.weight, quantized=quantized)}
        return self

    def step(self, states: torch.Tensor, positions: torch.Tensor, cache: HeadCache, visible: torch.Tensor) -> torch.Tensor:
        """Drafting (after :meth:`freeze`): ``n`` shallow states ``[n, D]`` at ``positions [n]``, their
        keys and values written to ``cache``'s next slots, row ``i`` attending where ``visible
        [n, cache.used + n]`` holds. Returns predicted features ``[n, D]``, :meth:`forward`'s function."""
        c = self.config
        qkv = self._fast["qkv"](F.rms_norm(states, (c.hidden,), self.input_norm.weight, c.eps))
        h = states + self._fast["o"](cached_attention(qkv, c, self.rope(positions, states.dtype), cache, visible))
        return F.rms_norm(h, (c.hidden,), self.out_norm.weight, c.eps)
