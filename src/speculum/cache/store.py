"""KV stores: where one forward's keys and values are written and what its queries read.

The decoder (:meth:`~speculum.runners.decoder.NativeDecoder.forward_with`) computes each layer's
queries, keys and values and hands them to one :class:`KVStore`; the store writes the new entries
where it keeps them and returns the attention over what it reads. Which store a forward gets
decides where its cache lives:

- :class:`BufferStore`: a static buffer ``[layers, 2, H_kv, C, d]`` (the plain cache, the CUDA
  graphs' buffer, a draft's own buffer);
- the slot pool's batched store (:class:`~speculum.runners.batched.PoolStore`, over
  :func:`put_rows`);
- a KV policy's cache (:class:`~speculum.runners.policy.PolicyStore`: the policy writes through
  :meth:`~speculum.cache.static.StaticKVCache.write` and reads what it selects);
- the draft views of self-speculation (:mod:`speculum.drafting.self_forward`, through
  :class:`FunctionStore`), layer subsets and learned heads' caches (:class:`DraftBuffer`).

Every one of them writes through :func:`put` or :func:`put_rows` (or the compiled layer's kernel,
which writes the same layout): the cache layout is known here. Stores are made per forward: they
carry the step (write slots, key count, masks) as well as the storage.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..attention import AttentionLayout, attention

_EMPTY = torch.empty(0)


class KVStore(Protocol):
    """What the decoder's layers call for attention."""

    # the compiled layer's operands (``kv, write, keys, {sliding: mask}``) where the whole layer may
    # run as one compiled call that writes and reads the buffer itself; None elsewhere
    compiled: tuple | None

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s new entries ``k, v [n, H_kv, d]`` and return the attention of
        ``q [n, H, d]`` over what the store reads: ``[n, H*d]``."""
        ...


class StoreBase:
    """A store as a write and a read (:meth:`attend` runs one, then the other)."""

    compiled: tuple | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, layer: int, sliding: bool, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write(layer, k, v)
        return self.read(layer, sliding, q)


def put(kv: torch.Tensor, at: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused: bool = False) -> None:
    """Entries ``k, v [n, H_kv, d]`` into one layer's ``kv [2, H_kv, C, d]`` at slots ``at .. at+n-1``
    (an int) or ``at [n]`` (a tensor: CUDA-graph capture, where the offset is data). ``fused``: keys
    and values in one copy (fewer kernels where each costs a launch)."""
    if fused:
        new = torch.stack((k, v)).transpose(1, 2)  # [2, H_kv, n, d]
        if isinstance(at, int):
            kv[:, :, at:at + k.shape[0]] = new
        else:
            kv.index_copy_(2, at, new)
    elif isinstance(at, int):
        kv[0, :, at:at + k.shape[0]] = k.transpose(0, 1)
        kv[1, :, at:at + k.shape[0]] = v.transpose(0, 1)
    else:
        kv[0].index_copy_(1, at, k.transpose(0, 1))
        kv[1].index_copy_(1, at, v.transpose(0, 1))


def put_rows(kv: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows of several sequences into one layer of a slot pool, ``kv [2, S, H_kv, C, d]``: row ``r``
    of ``k, v [N, H_kv, d]`` to slot ``slots[r]``, index ``at[r]``."""
    kv[0][slots, :, at] = k
    kv[1][slots, :, at] = v


class FunctionStore:
    """A store whose ``attend`` is a function of the same call, for a forward whose reads are
    assembled per call (the draft views of :mod:`speculum.drafting.self_forward`)."""

    compiled = None

    def __init__(self, attend):
        self.attend = attend


class BufferStore(StoreBase):
    """One forward over a static buffer ``kv [layers, 2, H_kv, C, d]``: the new entries go to slots
    ``write ..`` (or ``write [n]``), the queries attend over slots ``0 .. keys-1`` under
    ``masks {sliding: [g*n, keys] additive, or None}`` (rows folded as in :mod:`speculum.attention`).

    ``explicit``: attention by its explicit path whatever the row count (the reproducible mode);
    ``fused``: one copy per layer for keys and values; ``ops``: the compiled layer ops, which write
    and attend row by row (each row computed alone, as a one-token step would), and then
    :attr:`compiled` offers the whole layer as one call.

    ``window_start``: no query of this forward sees a slot below it on a sliding-window layer (its
    keys lie a window or more behind every query), so those layers read slots ``window_start ..
    keys-1`` only (the masks' columns alike): a long prompt's chunks attend over a window's keys,
    not the whole cache. (The compiled ops skip masked slots themselves.)
    """

    def __init__(self, kv: torch.Tensor, write: int | torch.Tensor, keys: int, masks: dict[bool, torch.Tensor | None],
                 layout: AttentionLayout, explicit: bool = False, fused: bool = False, ops=None,
                 window_start: int = 0):
        self.kv, self.at, self.keys, self.masks = kv, write, keys, masks
        self.window_start = window_start
        self.scale, self.softcap = layout.scale, layout.softcap
        self.explicit, self.fused, self.ops = explicit, fused, ops
        if ops is not None:
            self.compiled = (kv, write, keys, {sliding: _EMPTY if m is None else m for sliding, m in masks.items()})

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        put(self.kv[layer], self.at, k, v, self.fused)

    def read(self, layer: int, sliding: bool, q: torch.Tensor) -> torch.Tensor:
        kv, mask = self.kv[layer], self.masks[sliding]
        lo = self.window_start if sliding else 0
        if lo and mask is not None:
            mask = mask[..., lo:]
        return attention(q, kv[0, :, lo:self.keys], kv[1, :, lo:self.keys], mask, self.scale, self.softcap,
                         self.explicit)

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.attend_cache(q, k, v, self.kv, layer, self.at, self.keys, self.compiled[3][sliding],
                                         self.scale, self.softcap or 0.0)
        self.write(layer, k, v)
        return self.read(layer, sliding, q)


class DraftBuffer:
    """A drafter's own keys and values, ``kv [layers, 2, H_kv, C, d]`` with each slot's position
    ``pos [C]``: ``committed`` entries first, then ``used - committed`` pending ones (this step's
    drafted nodes), dropped by :meth:`rollback`. Grows by doubling. (A learned head's cache, one
    layer; a layer subset's.)"""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        self.kv = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.pos = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.committed = self.used = 0

    def reserve(self, n: int) -> None:
        """Room for ``n`` entries in all."""
        if n > self.kv.shape[3]:
            size = max(n, 2 * self.kv.shape[3])
            kv = self.kv.new_zeros(*self.kv.shape[:3], size, self.kv.shape[4])
            kv[:, :, :, :self.used] = self.kv[:, :, :, :self.used]
            pos = self.pos.new_zeros(size)
            pos[:self.used] = self.pos[:self.used]
            self.kv, self.pos = kv, pos

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """``k, v [n, H_kv, d]`` into ``layer``'s slots ``used ..`` (room reserved); returns the key
        count after them (``used`` moves on once the forward is done: :meth:`advance`)."""
        put(self.kv[layer], self.used, k, v)
        return self.used + k.shape[0]

    def advance(self, n: int) -> None:
        self.used += n

    def commit(self) -> None:
        self.committed = self.used

    def rollback(self) -> None:
        self.used = self.committed
