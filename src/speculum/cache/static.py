"""The static KV cache: one preallocated buffer for every layer, keys and values.

``kv [layers, 2, H_kv, C, d]``: slot ``c`` holds the entry for position ``c`` once committed. A
forward writes its ``n`` entries in place at slots ``length .. length+n-1`` (pending); a commit
keeps the root and the accepted tree path by one gather inside the buffer (every layer, keys and
values, in a single ``index_select``), and a rollback just lowers ``length``. Nothing is
concatenated per step.

Sliding-window layers (Gemma-3) keep every entry too: the attention mask hides keys outside the
window, so rollback works at any length (transformers' own sliding cache discards old entries and
cannot crop once the window is full). The price is memory: those layers hold the whole context
instead of the window; KV policies (:mod:`speculum.kv`) are where memory is traded.
"""

from __future__ import annotations

import torch

from .base import KVCache
from .store import put


class StaticKVCache(KVCache):
    """Static KV buffer with commit / rollback.

    Attributes:
        kv: ``[layers, 2, H_kv, C, d]``.
        fixed: True when the buffer may not be reallocated (CUDA graphs hold its address).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 capacity: int, buffer: torch.Tensor | None = None):
        self.fixed = buffer is not None
        # zeros: attention may span the whole buffer, masking the slots past the keys
        # (:func:`~speculum.attention.capacity_span`), so they must hold finite numbers
        self.kv = buffer if buffer is not None else torch.zeros(
            (layers, 2, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        super().__init__(self.kv.device)
        self.dtype = self.kv.dtype

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def _grow(self, extra: int) -> None:
        if self.fixed:
            raise ValueError(f"this cache holds {self.capacity} entries; {self.capacity + extra} were asked for")
        shape = list(self.kv.shape)
        shape[3] += extra
        new = torch.zeros(shape, dtype=self.kv.dtype, device=self.kv.device)
        new[:, :, :, : self.length].copy_(self.kv[:, :, :, : self.length])
        self.kv = new

    def entry_bytes(self) -> int:
        layers, two, heads, _, d = self.kv.shape
        return layers * two * heads * d * self.kv.element_size()

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        """One gather for every layer, keys and values: slots ``src [m]`` -> ``dst .. dst+m-1``."""
        self.kv[:, :, :, dst:dst + src.shape[0]] = self.kv.index_select(3, src)

    def append(self, entries: torch.Tensor) -> None:
        """Commit ``entries [layers, 2, H_kv, m, d]`` (copied from another cache) after the committed
        ones (room reserved)."""
        m = entries.shape[3]
        self.kv[:, :, :, self.length:self.length + m] = entries
        self.length += m

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New entries ``k, v [n, H_kv, d]`` into the pending slots ``length ..`` of ``layer``."""
        put(self.kv[layer], self.length, k, v)
