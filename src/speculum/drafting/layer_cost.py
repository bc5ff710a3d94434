"""What a self-draft through some of the target's layers costs and what it is worth: the rule
``swift`` (which layers to skip) and ``del`` (where to exit) choose by.

A draft forward through ``kept`` of the target's ``N`` layers and its LM head reads that share of
the weights a target step reads (decode is bound by the bytes it streams, so that share is its
cost in target steps). A chain of ``g`` drafted tokens, each accepted with probability ``a``
independently, commits ``(1 - a^(g+1)) / (1 - a)`` tokens per step on average (the bonus token
included) and costs ``g c + 1`` target steps (``g`` draft forwards of cost ``c``, one
verification): its *speed*, in units of plain decoding's, is the ratio.

Example: ``a = 0.8``, ``c = 0.25``: ``g = 3`` gives ``2.952 / 1.75 = 1.69``, ``g = 4`` gives
``3.362 / 2.0 = 1.68``, so the best chain is 3 long.
"""

from __future__ import annotations

from ..runners.decoder import NativeDecoder


def kept_share(decoder: NativeDecoder, kept: int) -> float:
    """The share of a target step's weights read by a forward through ``kept`` of its layers and its
    LM head (attention and MLP matrices per layer; the head as ``V x D``)."""
    s = decoder.shape
    layer = s.hidden * ((s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim)
    layer += 3 * s.hidden * decoder.layers[0].down.in_features
    head = s.vocab * s.hidden
    return (kept * layer + head) / (s.layers * layer + head)


def chain_speed(accept: float, cost: float, depth: int) -> float:
    """Expected tokens per step over target steps spent, for a chain of ``depth`` drafts (module docstring)."""
    a = min(max(accept, 0.0), 0.999)
    return (1 - a ** (depth + 1)) / (1 - a) / (depth * cost + 1)


def best_depth(accept: float, cost: float, depths: range) -> tuple[int, float]:
    """The chain length of ``depths`` with the highest :func:`chain_speed`, and that speed."""
    return max(((g, chain_speed(accept, cost, g)) for g in depths), key=lambda gs: (gs[1], -gs[0]))
