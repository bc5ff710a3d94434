"""The native runner's KV cache: one preallocated buffer for every layer, keys and values.

``kv [layers, 2, H_kv, C, d]``: slot ``c`` holds the entry for position ``c`` once committed. A
forward writes its ``n`` entries in place at slots ``length .. length+n-1`` (pending); the
engine's :meth:`commit` keeps the root and the accepted tree path by one gather inside the buffer
(every layer, keys and values, in a single ``index_select``), and :meth:`rollback` just lowers
``length``. Nothing is concatenated per step.

Sliding-window layers keep every entry as in :class:`speculum.cache.KVCache`: the attention
mask hides keys outside the window, so rollback works at any length.
"""

from __future__ import annotations

import torch

from ..cache import PendingEntries


class StaticKVCache(PendingEntries):
    """Static KV buffer with commit / rollback (the engine's cache protocol).

    Attributes:
        kv: ``[layers, 2, H_kv, C, d]``.
        length: committed entries (positions ``0 .. length-1``).
        pending: entries written by the last forward, not yet committed.
        fixed: True when the buffer may not be reallocated (CUDA graphs hold its address).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 capacity: int, buffer: torch.Tensor | None = None):
        self.fixed = buffer is not None
        self.kv = buffer if buffer is not None else torch.empty(
            (layers, 2, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.device = self.kv.device
        self.length = 0
        self.pending = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` entries (grows by doubling, keeps the committed ones)."""
        if capacity <= self.capacity:
            return
        if self.fixed:
            raise ValueError(f"this cache holds {self.capacity} entries; {capacity} were asked for")
        shape = list(self.kv.shape)
        shape[3] = max(capacity, 2 * self.capacity)
        new = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
        new[:, :, :, : self.length].copy_(self.kv[:, :, :, : self.length])
        self.kv = new

    def nbytes(self) -> int:
        """Bytes of the committed entries."""
        layers, two, heads, _, d = self.kv.shape
        return self.length * layers * two * heads * d * self.kv.element_size()

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        """One gather for every layer, keys and values: slots ``src [m]`` -> ``dst .. dst+m-1``."""
        self.kv[:, :, :, dst:dst + src.shape[0]] = self.kv.index_select(3, src)
