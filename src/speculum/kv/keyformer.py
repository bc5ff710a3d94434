"""``keyformer``: Keyformer (Adnan et al., 2024, "Keyformer: KV Cache Reduction through Key Tokens
Selection for Efficient Generative Inference", arXiv 2403.09054).

A recent window (``recent_ratio`` of the budget) plus the *key tokens*: the older tokens with the
highest accumulated score, per KV head, where a query's score for its keys is a Gumbel softmax of
its attention logits ``x``: ``softmax((x + g) / tau)`` with ``g`` standard Gumbel noise. The
temperature rises over the decoding, ``tau = tau_init + t (tau_end - tau_init) / T`` at the
``t``-th generated token of ``T`` (``tau_init`` over the prompt): as more tokens are discarded the
score is made smoother, so that tokens whose logits the missing keys would have shaped are not
judged by a skewed softmax. Scores accumulate over the prompt's queries and every committed token's,
as H2O's attention does, and eviction happens at prefill and while decoding as in H2O (the cache
runs ``slack`` past the budget, then is gathered back to it).

The noise is a pure function of ``(seed, layer, query head, query position, key position)`` (a
32-bit integer hash), and the temperature of the query's position: the same request gives the same
scores and output whatever the prefill's chunking, and a committed draft token votes as it would
have in a one-token step. With the engine trimming each tree at the next eviction
(:meth:`~speculum.kv.eviction.EvictionPolicy.draft_depth`), speculation under a lossy budget gives
plain decoding's output under it.

Example, budget 10, ``recent_ratio=0.3``, 40 prompt tokens: tokens 37..39 are kept as the recent
window; of tokens 0..36 the 7 with the highest summed ``softmax((x + g) / 1)`` over the 40 prompt
queries (and the query heads of the KV group) are the key tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import attention_scores, fold_queries
from ..options import parse_flag
from .h2o import H2OPolicy, H2OState

MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (xor-shift, multiply) of ``x`` in ``[0, 2^32)``: a Python int, or an int64
    tensor hashed elementwise in place (its products stay under ``2^63``)."""
    if isinstance(x, torch.Tensor):
        t = x >> 16
        x ^= t
        x.mul_(0x7FEB352D).bitwise_and_(MASK32)
        x ^= torch.bitwise_right_shift(x, 15, out=t)
        x.mul_(0x5BD1E995).bitwise_and_(MASK32)
        x ^= torch.bitwise_right_shift(x, 16, out=t)
        return x
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x5BD1E995) & MASK32
    return x ^ (x >> 16)


def keyed_gumbel(seed: int, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor, heads: int, group: int) -> torch.Tensor:
    """Standard Gumbel noise for folded query rows over keys, keyed by position: ``q_pos [r]`` query
    positions (folded rows ``j*r + i``, :func:`~speculum.attention.fold_queries`), ``k_pos [H_kv, L]``
    or ``[L]`` key positions -> ``[H_kv, g*r, L]`` float32, a pure function of (seed, layer, query
    head, query position, key position)."""
    base = mix32(mix32(seed & MASK32) ^ layer)
    head = torch.arange(heads * group, device=q_pos.device).view(heads, group, 1)  # query head h*g + j
    row = mix32(mix32(head ^ base) ^ q_pos.view(1, 1, -1)).view(heads, -1, 1)  # [H_kv, g*r, 1]
    key = mix32((k_pos.long() + 0x9E3779B9) & MASK32)
    key = key.view(1, 1, -1) if key.dim() == 1 else key[:, None, :]
    x = mix32(row ^ key)  # [H_kv, g*r, L]
    x >>= 8
    u = x.float().add_(0.5).mul_(2.0 ** -24)  # uniform in (0, 1)
    return u.log_().neg_().log_().neg_()


@dataclass
class KeyformerState(H2OState):
    """H2O's state plus the temperature schedule's origin and length."""

    start: int = 0  # prompt tokens prefilled: the first decoded row (position ``start``) is t = 1
    steps: int = 1  # T, the decoding length over which tau rises from tau_init to tau_end


class KeyformerPolicy(H2OPolicy):
    """Recent window + key tokens by accumulated Gumbel-softmax scores of the attention logits.

    Options: ``recent_ratio`` (0.3, the reference code's ``recent 30`` percent of the budget),
    ``tau_init`` (1.0), ``tau_end`` (2.0), ``steps`` (T; default: the new tokens the request's cache
    was sized for, which includes the verification tree's room), ``seed`` (0: the noise's key, the
    same for every request), ``decode`` (1: also evict while decoding; 0: select at prefill only and
    append the generated tokens, with no votes while decoding).
    """

    name = "keyformer"
    prefill_scores = "logits"

    def __init__(self, budget="0.25", recent_ratio: float = 0.3, tau_init: float = 1.0, tau_end: float = 2.0,
                 steps=None, seed: int = 0, decode=True):
        super().__init__(budget, recent_ratio)
        self.tau_init, self.tau_end = float(tau_init), float(tau_end)
        self.steps = None if steps in (None, "", "auto") else int(steps)
        self.seed = int(seed)
        if self.tau_init <= 0 or self.tau_end <= 0 or (self.steps is not None and self.steps < 1):
            raise ValueError("keyformer needs tau_init, tau_end > 0 and steps >= 1")
        self.evicts_while_decoding = parse_flag(decode)

    def begin_prefill(self, cache, n):
        super().begin_prefill(cache, n)
        steps = self.steps if self.steps is not None else max(1, cache.capacity_hint - n)
        cache.state = KeyformerState(cache.state.budget, cache.state.kept, start=n, steps=steps)

    def tau(self, state: KeyformerState, positions: torch.Tensor) -> torch.Tensor:
        """The temperature of the rows at ``positions [r]`` -> ``[r]`` float32: ``tau_init`` over the
        prompt, rising linearly to ``tau_end`` at the ``T``-th decoded token, then staying there."""
        t = (positions - state.start + 1).clamp(min=0).float() / state.steps
        return self.tau_init + (self.tau_end - self.tau_init) * t.clamp(max=1.0)

    def scores(self, layer: int, logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               tau: torch.Tensor) -> torch.Tensor:
        """Keyformer's score of folded ``logits [H_kv, g*r, L]`` (masked with ``-inf``) for rows at
        ``q_pos [r]``, keys at ``k_pos``, temperatures ``tau [r]``: ``softmax((x + g) / tau)`` summed
        over the rows -> ``[H_kv, L]``."""
        heads, rows = logits.shape[0], q_pos.shape[0]
        group = logits.shape[1] // rows
        noisy = logits.add_(keyed_gumbel(self.seed, layer, q_pos, k_pos, heads, group))
        return noisy.div_(tau.repeat(group)[None, :, None]).softmax(-1).sum(1)

    def prefill_vote(self, cache, layer, logits, positions):
        tau = torch.full(positions.shape, self.tau_init, device=logits.device)
        return self.scores(layer, logits, positions, torch.arange(logits.shape[-1], device=logits.device), tau)

    def votes(self, cache, layer, q, end, mask, positions):
        s = cache.layout
        logits = attention_scores(fold_queries(q, s.kv_heads), cache.kv[layer, 0, :, :end], mask, s.scale, s.softcap)
        return self.scores(layer, logits, positions, cache.pos[layer, :, :end], self.tau(cache.state, positions))
