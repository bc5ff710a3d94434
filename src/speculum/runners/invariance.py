"""Does a row's result depend on how many rows a step has? The premise of the reproducible mode.

In bfloat16 a matrix kernel may reduce along the inner dimension in another order for another
number of rows (a matrix-vector kernel for one row, other blockings or thread splits for more),
and a softmax may sum a short row in another order than a long one. Then the logits of a token
change in the last bit with the size of the step that computed them, and greedy output with the
draft's length. The reproducible mode (:meth:`NativeRunner.invariant
<speculum.runners.native.NativeRunner.invariant>`) avoids both:

- every matrix product runs over at least its *row floor*: the least row count from which this
  machine's kernel gives each row the same bits whatever the count (:func:`measure_floors`
  measures it on the model's own weights; short inputs get padding rows);
- attention takes the explicit path (scores, softmax, ``p @ v``) at every row count, over at least
  :data:`KEY_FLOOR` keys, so that a row's softmax sums its visible keys in the same lanes whether
  or not masked keys follow them.

Example: with oneDNN's bfloat16 kernels on an AVX-512 CPU, a one-row product through SmolLM2's
``down_proj`` (1536 inputs) rounds some rows differently from the same rows inside a two-row
product, while every count from 2 to 64 agrees; the other products agree from one row. Floors:
``down`` 2, everything else 1, so a one-token step pads only its ``down_proj`` input.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..attention import folded_attention

PROBE_ROWS = tuple(range(1, 17)) + (20, 24, 32, 40, 48, 56, 64)  # row counts the probe tries
KEY_FLOOR = 16  # attention in the reproducible mode spans at least this many keys (one AVX-512 vector of floats)
CHEAP_FLOOR = 2  # floors up to this are cheap: at most one padding row, in a one-token step


@dataclass(frozen=True)
class RowFloors:
    """Per kernel, the least rows it must be run over for row-independent results (1: any count)."""

    qkv: int = 1
    o: int = 1
    gate_up: int = 1
    down: int = 1
    head: int = 1
    step: int = 1  # rows of a whole step (the attention's floor)
    up_to: int = 1  # the largest row count probed: longer steps carry no guarantee

    @property
    def cheap(self) -> bool:
        """Whether padding to these floors costs little: every floor is at most :data:`CHEAP_FLOOR`."""
        return max(self.qkv, self.o, self.gate_up, self.down, self.head, self.step) <= CHEAP_FLOOR


NO_FLOORS = RowFloors()


def _floor_of(fn, x: torch.Tensor, counts: tuple[int, ...]) -> int | None:
    """The least ``m`` such that, for every probed count ``c >= m``, ``fn`` on any ``c`` consecutive
    rows of ``x [R, ...]`` gives the rows ``fn`` gives them among all ``R``; None when not even ``R``
    rows agree. ``fn(rows, first)`` maps rows to rows (``first``: the index of the first one). Each
    count is tried on every window of ``x`` that fits (``R // c`` of them): a kernel rounds some
    rows differently and not others, so one row would not tell. Agreement at ``R`` alone is no floor
    (None)."""
    ref = fn(x, 0)
    if not torch.equal(fn(x, 0), ref):
        return None
    floor = None
    for c in sorted(counts, reverse=True):
        if any(not torch.equal(fn(x[j:j + c], j), ref[j:j + c]) for j in range(0, x.shape[0] - c + 1, c)):
            break
        floor = c
    return floor if floor is not None and floor < x.shape[0] else None


def _chain_attention(decoder, k: torch.Tensor, v: torch.Tensor, context: int, extra: int, q: torch.Tensor,
                     first: int) -> torch.Tensor:
    """The explicit attention path for queries ``q [n, H, d]`` at positions ``context + first + i`` of
    a chain, each seeing the keys ``k, v [H_kv, >= keys, d]`` up to its own position, followed by
    ``extra`` keys that no query sees -> ``[n, H_kv, g, d]``."""
    s, dev = decoder.shape, q.device
    n = q.shape[0]
    keys = context + first + n + extra
    visible = torch.arange(keys, device=dev)[None, :] <= context + first + torch.arange(n, device=dev)[:, None]
    mask = torch.zeros(n, keys, dtype=q.dtype, device=dev).masked_fill_(~visible, float("-inf"))
    folded = q.view(n, s.kv_heads, s.group, s.head_dim).permute(1, 2, 0, 3).reshape(s.kv_heads, -1, s.head_dim)
    out = folded_attention(folded, k[:, :keys], v[:, :keys], mask.repeat(s.group, 1), s.attn_scale, True,
                           s.attn_softcap)
    return out.view(s.kv_heads, s.group, n, s.head_dim).permute(2, 0, 1, 3)


def _attention_floor(decoder, counts: tuple[int, ...], gen: torch.Generator) -> int | None:
    """:func:`_floor_of` for the explicit attention path over a chain (:func:`_chain_attention`):
    every step length must give each query the same output, and so must extra masked keys after the
    step, for contexts from below :data:`KEY_FLOOR` to past a few vector widths."""
    s, dev, dtype = decoder.shape, decoder.device, decoder.dtype
    rows = max(counts)
    floors = []
    for context in (KEY_FLOOR - 1, 37, 300):
        k, v = (torch.randn(s.kv_heads, context + rows + 8, s.head_dim, generator=gen).to(dtype).to(dev)
                for _ in range(2))
        q = torch.randn(rows, s.heads, s.head_dim, generator=gen).to(dtype).to(dev)
        for extra in (0, 3):
            floors.append(_floor_of(functools.partial(_chain_attention, decoder, k, v, context, extra), q, counts))
    return None if None in floors else max(floors)


def measure_floors(decoder, max_rows: int = 65) -> RowFloors | None:
    """``decoder``'s :class:`RowFloors` on this machine, probed on its first layer's linear layers,
    its output head and its attention shape with random inputs, for row counts up to ``max_rows``;
    None when some kernel gives no row count below ``max_rows`` row-independent results (the
    reproducible mode then pads every step to a fixed row count). Takes a second or two for a
    small model."""
    counts = tuple(c for c in PROBE_ROWS if c < max_rows) + (max_rows,)
    gen = torch.Generator().manual_seed(0)
    layer = decoder.layers[0]
    linears = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "head": decoder.head}
    floors = {}
    for name, linear in linears.items():
        x = torch.randn(max_rows, linear.in_features, generator=gen).to(decoder.dtype).to(decoder.device)
        floors[name] = _floor_of(lambda rows, first, f=linear: f(rows), x, counts)
    floors["step"] = _attention_floor(decoder, counts, gen)
    if None in floors.values():
        return None
    return RowFloors(**floors, up_to=max_rows)
