"""Attention: the one place that decides which keys a query sees, where its rotary positions put it,
and how attention over them is computed.

Every runner, cache and KV policy of speculum builds its masks, rotates its queries and keys and
computes attention here; this module imports nothing else of speculum.

Words used throughout:

- A forward feeds ``n`` *new* tokens (the root and its draft tree, or a prefill chunk) after ``L``
  cached ones. Their visibility is a bool mask ``[n, L + n]`` (True = visible): every cached key,
  and among the new tokens the tree's ancestor mask (causal for a chain or a prefill chunk).
- *Sliding-window* layers also hide keys ``window`` or more positions behind the query
  (transformers' rule ``key_pos > query_pos - window``).
- *Folded* queries: the ``g = H / H_kv`` query heads that share a KV head are stacked along the
  row axis, ``[n, H, d] -> [H_kv, g*n, d]`` (row ``j*n + i`` is query ``i`` of head ``j`` of the
  group), so grouped-query attention runs on the KV heads as stored, never on ``g`` repeated
  copies of the cache. Masks follow the same layout: :func:`grouped` turns ``[n, L]`` bool into
  an additive ``[g*n, L]``.

Example: a root and a two-branch tree ``[root, a, b]`` with ``a`` and ``b`` both children of the
root, after 3 cached tokens, ``g = 2``::

    visibility(3, positions=[3, 4, 4], new_mask=[[1,0,0],[1,1,0],[1,0,1]], window=None)[0]
    -> [[1,1,1, 1,0,0],
        [1,1,1, 1,1,0],
        [1,1,1, 1,0,1]]          # [n=3, L=6]
    grouped(that, 2, float32)    # [g*n=6, 6]: rows 0-2 for head 0, rows 3-5 for head 1,
                                 # 0 where visible, -inf elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

# folded query rows from which the explicit float32 math path beats SDPA on a CPU (see
# use_math_attention); BENCHMARKS.md has the measurements behind the bound
MATH_ATTENTION_MIN_ROWS = 8
# keys per kernel thread from which the math path also beats SDPA for fewer rows (decoding over a
# long context) on a CPU; BENCHMARKS.md ("The attention kernel's range") has the measurements
MATH_ATTENTION_KEYS_PER_THREAD = 2048
# the math path's float32 scores are computed in pieces of at most this many bytes (prefill chunks
# over long contexts): past a few MB the softmax passes leave the CPU's cache and run slower
SCORE_BLOCK_BYTES = 4 << 20
# a step over the first slots of a KV buffer attends over the whole buffer (the rest masked) when
# at most 1/SPAN_SLACK of it lies beyond them (see capacity_span)
SPAN_SLACK = 8


@dataclass(frozen=True)
class AttentionLayout:
    """A model's attention as caches and KV policies see it.

    ``sliding [layers]``: True for sliding-window layers (which hide keys ``window`` or more
    positions behind the query); ``rotary [layers]``: each layer's :class:`Rotary` (where a cache
    must move keys to new positions: StreamingLLM's rolling positions), or empty.
    """

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None = None
    window: int | None = None
    sliding: tuple[bool, ...] = ()
    rotary: tuple[Rotary, ...] = field(default=(), compare=False, repr=False)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding) and self.sliding[layer]


@dataclass
class Step:
    """What every layer's attention needs to know about one forward's ``n`` new tokens."""

    positions: torch.Tensor  # [n] rotary positions
    new_mask: torch.Tensor | None  # [n, n] bool among the new tokens (True = visible); None = causal
    # what a KV policy derives from the step alone, made at the first layer and shared by the others
    # (:meth:`speculum.kv.rows.RowView.of`); a step lives for one forward
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        return self.positions.shape[0]


# -- rotary positions ---------------------------------------------------------------------------

class Rotary:
    """Rotary embedding with a fixed ``inv_freq [d/2]`` and attention scaling (from transformers' init)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        self.inv_freq, self.scaling = inv_freq.float(), float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> ``cos, sin [n, 1, d]`` in ``dtype`` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype)[:, None], (emb.sin() * self.scaling).to(dtype)[:, None]

    def shift(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys ``[..., m, d]`` roped at positions ``p [m]`` -> the same keys at ``p + delta``, computed
        in float32 (rotations compose: ``R(p + delta) = R(delta) R(p)``; the attention scaling, already
        applied once, is not applied again). ``delta [m]`` integer offsets."""
        freqs = delta[:, None].float() * self.inv_freq  # [m, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [m, d]
        return rotate(keys.float(), emb.cos(), emb.sin()).to(keys.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [..., d]`` (transformers' ``x cos + rotate_half(x) sin``)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def rotate_fused(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` in three kernels: ``rotate_half(x) sin == roll(x, d/2) * [-sin_1, sin_2]``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


# -- visibility ---------------------------------------------------------------------------------

def in_window(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window rule: ``key_pos [..., L]`` against ``query_pos [n]`` -> bool ``[..., n, L]``,
    True where the key lies fewer than ``window`` positions behind the query."""
    return key_pos[..., None, :] > query_pos[:, None] - window


def sinks_or_window(key_pos: torch.Tensor, query_pos: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """The streaming rule (StreamingLLM's attention sinks, DuoAttention's streaming heads): ``key_pos [L]``
    against ``query_pos [n]`` -> bool ``[n, L]``, True where the key is one of the first ``sinks``
    positions or lies fewer than ``window`` positions behind the query. (Causality is the caller's.)"""
    return (key_pos < sinks)[None, :] | in_window(key_pos, query_pos, window)


def window_start(positions: torch.Tensor, window: int | None) -> int:
    """The first position any of the queries at ``positions [n]`` still sees through a sliding
    ``window`` (0 without one): keys before it can be skipped."""
    return 0 if window is None else max(0, int(positions.min()) - window + 1)


def window_first_slot(held: torch.Tensor, positions: torch.Tensor, window: int | None) -> int:
    """:func:`window_start` where slots no longer equal positions: the first slot where any head holds
    a position the queries at ``positions [n]`` still see through ``window`` (``L`` if none; 0 without
    a window). ``held [H_kv, L]``: the positions the slots hold, increasing along ``L`` in every head
    (selected entries stay in order)."""
    first = window_start(positions, window)
    if first == 0:
        return 0
    # one head at a time: each head's row of a slot buffer is contiguous, a [H_kv, L] slice of it is not
    return min((int(torch.searchsorted(row, first)) for row in held), default=held.shape[-1])


# The static cache's sliding-window layers skip the slots a window behind a step's first row once there
# are this many (a long prompt's later chunks, long decodes); below it they read them masked, as
# transformers does, so that short contexts keep transformers' exact logits.
WINDOW_SKIP_MIN = 1024


def window_skip(first: int, window: int | None) -> int:
    """:func:`window_start` for rows at positions ``first`` and later, where it skips at least
    :data:`WINDOW_SKIP_MIN` slots, else 0 (read every slot, the hidden ones masked)."""
    start = 0 if window is None else first - window + 1
    return start if start >= WINDOW_SKIP_MIN else 0


def visibility(length: int, positions: torch.Tensor, new_mask: torch.Tensor | None, window: int | None,
               start: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which keys ``n`` new tokens see after ``length`` cached ones: ``(full, sliding)``, each a
    ``[n, length - start + n]`` bool mask (True = visible) over slots ``start ..`` or None
    (everything visible).

    ``positions [n]`` of the new tokens; ``new_mask [n, n]`` among them (None = causal). ``sliding``
    also applies the window (it is ``full`` when ``window`` is None or hides nothing); cached
    slot ``c`` holds position ``c``.
    """
    n = positions.shape[0]
    dev = positions.device
    if new_mask is None and n > 1:
        new_mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    full = None
    if new_mask is not None:
        full = torch.cat([torch.ones(n, length - start, dtype=torch.bool, device=dev), new_mask.to(dev)], dim=1)
    sliding = full
    if window is not None and int(positions.max()) - window >= start:
        key_pos = torch.cat([torch.arange(start, length, device=dev), positions])
        visible = in_window(key_pos, positions, window)  # [n, L]
        if not bool(visible.all()):
            sliding = visible if full is None else (full & visible)
    return full, sliding


def padded_visibility(length: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor, keys: int,
                      window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`visibility` for a fixed-shape step (CUDA-graph capture: no host synchronisation).

    ``B`` rows (the real new tokens, then padding) are written at slots ``length .. length+B-1`` of
    a buffer whose first ``keys`` slots are attended. ``length [1]`` committed slots,
    ``positions [B]``, ``tree [B, B]`` bool ancestor mask (padding rows see only themselves).
    Returns ``(full, sliding)`` bool ``[B, keys]``: committed slots are visible (within the window on
    sliding layers, key position = slot), the new block follows ``tree``, later slots are hidden.
    """
    b = positions.shape[0]
    dev = positions.device
    rel = torch.arange(keys, device=dev) - length  # [K] slot index relative to the new block
    past = rel < 0
    new_col = rel.clamp(0, b - 1)
    visible = past[None, :] | (tree[:, new_col] & (rel < b)[None, :])  # [B, K]
    if window is None:
        return visible, visible
    key_pos = torch.where(past, torch.arange(keys, device=dev), positions[new_col])  # [K]
    return visible, visible & in_window(key_pos, positions, window)


def grouped(mask: torch.Tensor | None, group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``[n, L]`` bool (True = visible) -> ``[g*n, L]`` additive mask (0 / -inf) in ``dtype``, its rows
    repeated for the ``g`` query heads that share a KV head (the folded layout). A per-KV-head mask
    ``[H_kv, n, L]`` becomes ``[H_kv, g*n, L]`` the same way. None stays None."""
    if mask is None:
        return None
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return add.repeat(*([1] * (mask.dim() - 2)), group, 1)


# -- attention ----------------------------------------------------------------------------------

def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``q [n, H, d]`` -> ``[H_kv, g*n, d]``: row ``j*n + i`` is query ``i`` of head ``j`` of a KV group."""
    n, heads, d = q.shape
    g = heads // kv_heads
    return q.view(n, kv_heads, g, d).permute(1, 2, 0, 3).reshape(kv_heads, g * n, d)


def unfold_rows(out: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`fold_queries` for attention outputs: ``[H_kv, g*n, d]`` -> ``[n, H*d]``."""
    kv_heads, rows, d = out.shape
    g = rows // n
    return out.view(kv_heads, g, n, d).permute(2, 0, 1, 3).reshape(n, kv_heads * g * d)


def _broadcasts_into(shape: torch.Size, into: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``into`` without growing it (an in-place operand)."""
    return len(shape) <= len(into) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(into)))


def attention_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float | None = None) -> torch.Tensor:
    """Float32 attention logits ``q @ k^T * scale``, soft-capped (``tanh(x / c) * c``, Gemma-2) and
    masked: ``q [..., R, d]``, ``k [..., L, d]``, additive ``mask`` broadcastable to ``[..., R, L]``
    -> ``[..., R, L]``."""
    if not k.is_contiguous():
        # a cache's view up to its length (spare capacity beyond it): matmul takes a slow strided
        # path for its transpose, dearer than copying the keys first (decode-sized queries)
        k = k.contiguous()
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # a fresh tensor: in place from here
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        if _broadcasts_into(mask.shape, scores.shape):
            scores = scores.add_(mask)  # in place: a mixed-dtype out-of-place add is much slower here
        else:
            scores = scores + mask
    return scores


def use_math_attention(rows: int, device: torch.device, keys: int = 0) -> bool:
    """Whether :func:`folded_attention` should take its math path for ``rows`` folded query rows
    over ``keys`` keys: on a CPU, from verification-sized inputs up (prefill chunks included: in
    blocks, it runs about twice as fast as SDPA's CPU flash kernel), and for any rows over a long
    context (from :data:`MATH_ATTENTION_KEYS_PER_THREAD` keys per kernel thread), where SDPA's flash
    kernel, which splits a few query rows over the KV heads only, is slower than two matrix products
    (BENCHMARKS.md, "The attention kernel's range")."""
    if device.type != "cpu":
        return False
    return rows >= MATH_ATTENTION_MIN_ROWS or keys >= MATH_ATTENTION_KEYS_PER_THREAD * torch.get_num_threads()


def capacity_span(keys: int, capacity: int, rows: int, device: torch.device) -> bool:
    """Whether a step over the first ``keys`` slots of a ``[H_kv, capacity, d]`` KV buffer should
    attend over all ``capacity`` slots instead, the ones past ``keys`` masked (:func:`span_mask`).

    On a CPU's math path (:func:`use_math_attention` for ``rows`` folded rows) a slice of the
    buffer is not contiguous, and its keys and values are copied before the two matrix products,
    in every layer; the whole buffer is contiguous (BENCHMARKS.md, "Decode core: no copied KV
    slices", measures the gain). Taken where at most
    ``1/SPAN_SLACK`` of the buffer lies beyond ``keys``, so that the masked slots cost less than
    the copy. The slots past ``keys`` must hold finite numbers (the caches zero their buffers)."""
    return keys < capacity and (capacity - keys) * SPAN_SLACK <= keys and use_math_attention(rows, device, keys)


def span_mask(mask: torch.Tensor | None, keys: int, capacity: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """An additive mask ``[..., R, keys]`` (or None: every key visible) extended to ``[..., R, capacity]``
    (``[1, capacity]`` from None), the slots past ``keys`` hidden: see :func:`capacity_span`."""
    if mask is None:
        mask = torch.zeros(1, keys, dtype=dtype, device=device)
    return torch.nn.functional.pad(mask, (0, capacity - keys), value=float("-inf"))


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, math: bool, softcap: float | None = None, row_blocks: bool = False) -> torch.Tensor:
    """Attention over folded queries.

    Shapes: ``q [..., H_kv, R, d]`` (``R = g*n`` folded rows), ``k, v [..., H_kv, L, d]``, ``mask``
    additive, broadcastable to ``[..., H_kv, R, L]`` (see :func:`grouped`), or None. Returns
    ``[..., H_kv, R, d]``. ``math`` (the caller's choice; forced by soft-capping) runs
    :func:`attention_scores`, softmax and a matmul explicitly in float32; otherwise
    ``scaled_dot_product_attention``.

    The math path keeps its float32 scores under :data:`SCORE_BLOCK_BYTES`: one matrix ``[R, L]``
    (a head of a sequence) at a time where all of them together would be larger, and, with
    ``row_blocks`` (prefill chunks, whose rows need not be computed alike for any row count), runs
    of rows of one matrix where even that is larger. Pieces of whole matrices give each row the
    result it gets in one piece, bit for bit (tested), so that the reproducible mode's decoding
    groups do not depend on how many sequences share a group.
    """
    if not math and softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _blocked_math(q, k if k.is_contiguous() else k.contiguous(), v, mask, scale, softcap, row_blocks)


def _blocked_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  softcap: float | None, row_blocks: bool) -> torch.Tensor:
    """:func:`folded_attention`'s math path in pieces whose float32 scores stay under
    :data:`SCORE_BLOCK_BYTES`: runs along the first leading dimension of ``q [..., R, d]`` (whose
    leading dimensions are the full ones; ``k``, ``v`` and ``mask`` may broadcast), then the next,
    then (``row_blocks``) runs of rows of one ``[R, L]`` matrix."""
    lead, rows, keys = q.shape[:-2], q.shape[-2], k.shape[-2]
    size = prod(lead) * rows * keys * 4
    if size <= SCORE_BLOCK_BYTES:
        return _math_attention(q, k, v, mask, scale, softcap)
    if lead:
        def at(t: torch.Tensor | None, index: int | slice) -> torch.Tensor | None:
            if t is None or t.dim() < q.dim():  # broadcasts over q's first dimension
                return t
            if t.shape[0] == 1:
                return t[0] if isinstance(index, int) else t
            return t[index]

        run = lead[0] * SCORE_BLOCK_BYTES // size
        if run < 1 or lead[0] == 1:  # one entry at a time, each split further
            return torch.stack([_blocked_math(q[i], at(k, i), at(v, i), at(mask, i), scale, softcap, row_blocks)
                                for i in range(lead[0])])
        return torch.cat([_math_attention(q[i:i + run], at(k, slice(i, i + run)), at(v, slice(i, i + run)),
                                          at(mask, slice(i, i + run)), scale, softcap)
                          for i in range(0, lead[0], run)])
    if not row_blocks:
        return _math_attention(q, k, v, mask, scale, softcap)
    step = max(1, SCORE_BLOCK_BYTES // (keys * 4))
    row_mask = mask is not None and mask.shape[-2] != 1
    return torch.cat([_math_attention(q[i:i + step], k, v, mask[..., i:i + step, :] if row_mask else mask, scale, softcap)
                      for i in range(0, rows, step)])


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, softcap: float | None) -> torch.Tensor:
    """The explicit path of :func:`folded_attention`, in one piece (same shapes)."""
    return torch.matmul(attention_scores(q, k, mask, scale, softcap).softmax(-1).to(v.dtype), v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None, explicit: bool = False) -> torch.Tensor:
    """Grouped-query attention of ``q [n, H, d]`` over ``k, v [H_kv, L, d]`` -> ``[n, H*d]``, with the
    folded additive ``mask [g*n, L]`` or ``[H_kv, g*n, L]`` (or None), without repeating KV heads;
    :func:`use_math_attention` picks the kernel, unless ``explicit`` asks for the math path whatever
    the row count (the reproducible mode: its rows are computed alike for any number of rows)."""
    qg = fold_queries(q, k.shape[0])
    math = explicit or use_math_attention(qg.shape[1], q.device, k.shape[1])
    return unfold_rows(folded_attention(qg[None], k[None], v[None], mask, scale, math, softcap,
                                        row_blocks=not explicit)[0], q.shape[0])


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """Softmax attention weights ``[H_kv, g*n, L]`` (float32) of ``q [n, H, d]`` over ``k [H_kv, L, d]``,
    for policies that score cached tokens by the attention they receive."""
    return attention_scores(fold_queries(q, k.shape[0]), k, mask, scale, softcap).softmax(-1)


def attention_parts(q: torch.Tensor, parts: list[tuple], scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q [n, H, d]`` over keys and values held in several parts, as over their
    concatenation (one softmax over every part's keys) -> ``[n, H*d]``, explicitly in float32.

    Each part is ``(k [H_kv, L_i, d_i], v [H_kv, L_i, d], mask, channels)``: ``mask`` additive
    ``[g*n, L_i]`` or ``[H_kv, g*n, L_i]`` (or None), ``channels [H_kv, d_i]`` the query channels the
    part's keys keep (ThinK's pruned keys; None: all ``d``)."""
    qg = fold_queries(q, parts[0][0].shape[0])  # [H_kv, g*n, d]
    logits = []
    for k, _, mask, channels in parts:
        qp = qg if channels is None else qg.gather(-1, channels[:, None, :].expand(-1, qg.shape[1], -1))
        logits.append(attention_scores(qp, k, mask, scale, softcap))
    probs = torch.cat(logits, dim=-1).softmax(-1)  # [H_kv, g*n, sum L_i]
    out, at = None, 0
    for k, v, _, _ in parts:
        o = torch.matmul(probs[..., at:at + k.shape[1]].to(v.dtype), v)
        out, at = o if out is None else out + o, at + k.shape[1]
    return unfold_rows(out, q.shape[0])
