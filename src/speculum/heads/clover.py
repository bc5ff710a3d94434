"""Clover heads (Xiao et al. 2024, "Clover: Regressive Lightweight Speculative Decoding with
Sequential Knowledge", https://arxiv.org/abs/2405.00263): Medusa-style heads on the target's last
feature made sequential, with knowledge of the context and of the tokens drafted before them.

Three parts on the frozen target's final features ``f_0 .. f_t`` ``[T, D]``:

- **Augmenting block**: one causal attention layer over the context features with a residual,
  ``a_i = f_i + Attn(f_i; f_0 .. f_i)``, whose output ``a_t`` starts the draft state (``s_0 = a_t``)
  and whose outputs ``a_0 .. a_t`` are what the decoder attends to. It adapts the target's
  features, trained for the next token only, to drafting several.
- **Regressive attention decoder** (shared by all depths): from the state ``s_{k-1}`` ``[D]`` and the
  embedding of the token ``x_{t+k}`` just drafted (the root for ``k = 1``),
  ``u = W_in [s_{k-1}; e(x_{t+k})]`` (starting as the identity on ``s_{k-1}``) and
  ``s_k = u + Attn(u; a_0 .. a_t)``, the query from ``u``, keys and values from the augmented
  context. This *regressive connection* makes each depth's state depend on the whole drafted path.
- **Heads**: head ``k`` is ``layers`` residual SiLU blocks on ``s_k``, then the target's LM head,
  and predicts ``x_{t+1+k}``.

Example (``K = 3``): the target's feature at ``t`` chose the root ``x_{t+1} = "the"``; head 1 reads
``s_1 = dec(s_0, e("the"))`` and drafts ``"cat"``; head 2 reads ``s_2 = dec(s_1, e("cat"))``, so a
sibling branch ``"dog"`` gets its own continuation, as in Hydra, and every depth also looks back at
the context through the decoder's attention, which Hydra's MLP heads cannot.

Departures from the paper: the heads share the target's LM head (optionally trimmed) instead of
owning one; the added attention layers carry no positional encoding (the target's features already
do) and the augmenting block is one attention layer without an MLP (the small targets here).

Shapes: ``D`` hidden size, ``H`` attention heads of ``D / H`` each, ``K`` heads (draft depths),
``T`` context tokens, ``m`` paths drafted at once, ``B`` batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .medusa import MedusaConfig, ResBlock


@dataclass(frozen=True)
class CloverConfig(MedusaConfig):
    """The heads' shape (Medusa's fields and the attention heads), saved beside their weights."""

    attn_heads: int = 4  # H of the augmenting block and the decoder (divides D)


class ContextAttention(nn.Module):
    """Queries of ``[..., n, D]`` over keys and values made from a context ``[..., T, D]``; the
    output projection starts at zero (the layer adds nothing at first)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.o_proj.weight)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n, D]`` -> ``[..., H, n, D / H]``."""
        return x.unflatten(-1, (self.heads, -1)).transpose(-3, -2)

    def keys_values(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``context [..., T, D]`` -> keys and values ``[..., H, T, D / H]`` each."""
        return self.split(self.k_proj(context)), self.split(self.v_proj(context))

    def attend(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``x [..., n, D]`` over ``keys`` / ``values`` ``[..., H, T, D / H]``; ``mask [n, T]``
        bool (True: visible) or None (all). Returns the projected output ``[..., n, D]``."""
        out = F.scaled_dot_product_attention(self.split(self.q_proj(x)), keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(-3, -2).flatten(-2))


class CloverHeads(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        d = config.hidden
        if d % config.attn_heads:
            raise ValueError(f"clover's {config.attn_heads} attention heads do not divide the hidden size {d}")
        self.config = config
        self.augment = ContextAttention(d, config.attn_heads)
        self.decoder = ContextAttention(d, config.attn_heads)
        self.in_proj = nn.Linear(2 * d, d)  # [s; e] -> u, the identity on s at first
        with torch.no_grad():
            self.in_proj.weight.zero_()
            self.in_proj.weight[:, :d] = torch.eye(d)
            self.in_proj.bias.zero_()
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(d) for _ in range(config.layers)))
                                   for _ in range(config.num_heads))

    def augmented(self, feats: torch.Tensor) -> torch.Tensor:
        """Training: the augmenting block over ``feats [B, T, D]``, causally -> ``[B, T, D]``."""
        keys, values = self.augment.keys_values(feats)
        causal = torch.ones(feats.shape[-2], feats.shape[-2], dtype=torch.bool, device=feats.device).tril()
        return feats + self.augment.attend(feats, keys, values, causal)

    def step(self, state: torch.Tensor, embed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """The regressive decoder: ``state``, ``embed`` ``[..., n, D]`` and the augmented context's
        decoder keys / values ``[..., H, T, D / H]`` -> the next state ``[..., n, D]``."""
        u = self.in_proj(torch.cat((state, embed), dim=-1))
        return u + self.decoder.attend(u, keys, values, mask)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Training (teacher forcing), every position at once: ``feats [B, T, D]`` and ``embeds
        [B, T, K, D]`` (at ``t``: of ``x_{t+1} .. x_{t+K}``) -> every head's output ``[B, T, K, D]``
        (head ``k`` at index ``k - 1``); position ``t`` attends to the context up to ``t``."""
        context = self.augmented(feats)
        keys, values = self.decoder.keys_values(context)
        causal = torch.ones(feats.shape[-2], feats.shape[-2], dtype=torch.bool, device=feats.device).tril()
        state, outs = context, []
        for k, head in enumerate(self.heads):
            state = self.step(state, embeds[..., k, :], keys, values, causal)
            outs.append(head(state))
        return torch.stack(outs, dim=-2)

    def freeze(self, quantized: bool = False) -> CloverHeads:
        """Ready for drafting (its products stay float: ``quantized`` is accepted and ignored)."""
        return self.eval().requires_grad_(False)


class CloverContext:
    """A request's context for drafting with ``heads``, grown as the target caches tokens: the
    augmenting block's keys / values ``[H, T, D / H]`` and the decoder's over the augmented features,
    and the last augmented feature ``s_0`` ``[D]``."""

    def __init__(self, heads: CloverHeads):
        self.heads = heads
        self.aug_keys = self.aug_values = self.dec_keys = self.dec_values = None
        self.last: torch.Tensor | None = None

    def extend(self, feats: torch.Tensor) -> None:
        """The final features ``[n, D]`` of the ``n`` tokens just cached, in order."""
        h, n = self.heads, feats.shape[0]
        keys, values = h.augment.keys_values(feats)
        self.aug_keys = keys if self.aug_keys is None else torch.cat((self.aug_keys, keys), dim=-2)
        self.aug_values = values if self.aug_values is None else torch.cat((self.aug_values, values), dim=-2)
        total = self.aug_keys.shape[-2]
        # the new rows see every earlier row and themselves (causal among them)
        mask = torch.ones(n, total, dtype=torch.bool, device=feats.device).tril(total - n)
        augmented = feats + h.augment.attend(feats, self.aug_keys, self.aug_values, mask)
        keys, values = h.decoder.keys_values(augmented)
        self.dec_keys = keys if self.dec_keys is None else torch.cat((self.dec_keys, keys), dim=-2)
        self.dec_values = values if self.dec_values is None else torch.cat((self.dec_values, values), dim=-2)
        self.last = augmented[-1]

    def step(self, states: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``m`` paths' states and drafted tokens' embeddings ``[m, D]`` -> their next states ``[m, D]``."""
        return self.heads.step(states, embeds, self.dec_keys, self.dec_values)

    def head(self, k: int, states: torch.Tensor) -> torch.Tensor:
        """Head ``k``'s features ``[m, D]`` (for the LM head) of states ``[m, D]``."""
        return self.heads.heads[k - 1](states)
