"""A pool of KV slots: one buffer for several sequences, so that one forward can serve them all.

``kv [layers, 2, S, H_kv, C, d]``: slot ``s`` is one sequence's static cache, ``kv[:, :, s]`` (the
:class:`~speculum.cache.static.StaticKVCache` layout, as a view). Because the slots of the running
sequences sit side by side, a batched forward attends over ``kv[i, 0, lo:hi]`` for all of them with
one kernel and no copy (:mod:`speculum.runners.batched`).

Slots are kept compact: :meth:`SlotPool.acquire` hands out the lowest free slot, and
:meth:`SlotPool.release` moves the highest occupied slot's committed entries into the freed one,
so ``S`` running sequences always occupy slots ``0 .. S-1``. The pool grows (every slot at once,
by doubling) when a sequence needs more than ``C`` entries.

Example: slots 0, 1, 2 hold sequences a, b, c; releasing b copies c's entries into slot 1 and
c's cache now reads slot 1; the next sequence gets slot 2.
"""

from __future__ import annotations

import torch

from .base import KVCache
from .static import StaticKVCache


class SlotPool:
    """The shared buffer and its slot bookkeeping.

    Args:
        layers, kv_heads, head_dim, dtype, device: the model's KV layout.
        slots: the most sequences held at once.
        capacity: entries per slot to start with (grows by doubling).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 slots: int, capacity: int = 1024):
        if slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {slots}")
        self.slots = slots
        self.kv = torch.zeros((layers, 2, slots, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.caches: list[SlotCache | None] = [None] * slots  # slot -> the cache holding it

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def used(self) -> int:
        """Occupied slots (always ``0 .. used-1``)."""
        return sum(c is not None for c in self.caches)

    def acquire(self) -> SlotCache:
        """A cache on the lowest free slot (raises RuntimeError when every slot is taken)."""
        for s, c in enumerate(self.caches):
            if c is None:
                cache = SlotCache(self, s)
                self.caches[s] = cache
                return cache
        raise RuntimeError(f"all {self.slots} KV slots are in use")

    @torch.inference_mode()
    def release(self, cache: SlotCache) -> None:
        """Free ``cache``'s slot; the highest occupied slot moves into it (keeps slots compact)."""
        s = cache.slot
        if s < 0 or self.caches[s] is not cache:
            return
        self.caches[s] = None
        cache.slot = -1
        last = max((i for i, c in enumerate(self.caches) if c is not None), default=-1)
        if last > s:
            moved = self.caches[last]
            n = moved.length + moved.pending
            self.kv[:, :, s, :, :n] = self.kv[:, :, last, :, :n]
            self.caches[s], self.caches[last] = moved, None
            moved.slot = s

    @torch.inference_mode()
    def grow(self, capacity: int) -> None:
        """Make every slot hold at least ``capacity`` entries (doubling), keeping their contents."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        shape = list(self.kv.shape)
        shape[4] = new_cap
        new = torch.zeros(shape, dtype=self.kv.dtype, device=self.kv.device)
        new[:, :, :, :, : self.capacity] = self.kv
        self.kv = new

    def entry_bytes(self) -> int:
        layers, two, _, heads, _, d = self.kv.shape
        return layers * two * heads * d * self.kv.element_size()


class SlotCache(StaticKVCache):
    """One sequence's cache: slot ``slot`` of a :class:`SlotPool`, with the static cache's commit,
    rollback and byte counts. ``kv`` is the view ``[layers, 2, H_kv, C, d]`` (re-read after the pool
    grows or the slot moves); growth grows the whole pool."""

    fixed = False

    def __init__(self, pool: SlotPool, slot: int):
        KVCache.__init__(self, pool.kv.device)  # the buffer is the pool's: no StaticKVCache allocation
        self.pool, self.slot = pool, slot
        self.dtype = pool.kv.dtype

    @property
    def kv(self) -> torch.Tensor:
        if self.slot < 0:
            raise RuntimeError("this KV cache's slot was released")
        return self.pool.kv[:, :, self.slot]

    def _grow(self, extra: int) -> None:
        self.pool.grow(self.capacity + extra)

    @torch.inference_mode()
    def load(self, entries: torch.Tensor) -> None:
        """Commit ``entries [layers, 2, H_kv, m, d]`` (a stored prefix's keys and values) as slots
        ``0 .. m-1`` of an empty cache."""
        if self.length or self.pending:
            raise RuntimeError("a prefix loads into an empty cache only")
        m = entries.shape[3]
        self.reserve(m)
        self.kv[:, :, :, :m] = entries
        self.length = m
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def release(self) -> None:
        """Give the slot back to the pool."""
        self.pool.release(self)
