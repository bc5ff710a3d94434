"""The KV cache the engine owns.

One preallocated buffer per layer, ``[batch=1, kv_heads, capacity, head_dim]``. A forward pass
writes its ``n`` new entries in place after the ``length`` committed ones (no concatenation);
they stay *pending* until the engine calls :meth:`KVCache.commit` with the indices of the entries
to keep (the root token and the accepted path of the draft tree). Rejected entries are simply
overwritten by the next step. :meth:`KVCache.rollback` shortens the committed length.

Sliding-window layers (Gemma-3) keep every entry too and the runner's attention mask hides what
lies outside the window, so rollback works at any length (transformers' own sliding cache
discards old entries and cannot crop once the window is full). The price is memory: those
layers hold the whole context instead of the window; KV policies (``kv/``) are where memory is
traded.

Subclassing transformers' ``Cache`` lets the model's attention layers call :meth:`update` as
they do with their own caches.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class PendingEntries:
    """Commit / rollback bookkeeping shared by the engine's caches.

    A subclass holds ``length`` committed and ``pending`` uncommitted entries and implements
    ``_move_entries(src, dst)``, which gathers slots ``src`` to ``dst ..`` inside its buffers.
    """

    length: int
    pending: int
    device: torch.device

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    @torch.inference_mode()
    def commit(self, keep: list[int] | None = None) -> None:
        """Commit pending entries: all of them (``keep=None``) or those at indices ``keep``.

        ``keep`` indexes the pending block (``0`` is the first token of the last forward) and must
        be increasing. A prefix ``[0, 1, ..., m-1]`` costs nothing; other subsets (a tree path)
        are gathered to the front of the pending block.
        """
        if keep is None:
            self.length += self.pending
        else:
            m = len(keep)
            if any(i >= self.pending for i in keep):
                raise IndexError(f"keep {keep} outside the {self.pending} pending entries")
            if keep != list(range(m)):
                self._move_entries(torch.tensor(keep, device=self.device) + self.length, self.length)
            self.length += m
        self.pending = 0

    def rollback(self, length: int) -> None:
        """Drop committed entries past ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length
        self.pending = 0


class KVCache(PendingEntries, Cache):
    """Static per-layer KV buffers with commit / rollback.

    Attributes:
        length: number of committed entries (positions ``0 .. length-1``).
        pending: entries written by the last forward after ``length`` and not yet committed.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 1024):
        super().__init__(layers=[])
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity = 0
        self.keys: list[torch.Tensor] = []    # each [1, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []  # each [1, kv_heads, capacity, head_dim]
        self.length = 0
        self.pending = 0
        self.reserve(capacity)

    # -- storage ---------------------------------------------------------------------------
    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` entries (grows by doubling, keeps the committed ones)."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        shape = (1, self.kv_heads, new_cap, self.head_dim)
        new_k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip(self.keys + self.values, new_k + new_v):
            new[:, :, : self.length].copy_(old[:, :, : self.length])
        self.keys, self.values, self.capacity = new_k, new_v, new_cap

    def nbytes(self) -> int:
        """Bytes of the committed entries across all layers (the figure KV policies shrink)."""
        per_entry = 2 * self.num_layers * self.kv_heads * self.head_dim * self.keys[0].element_size()
        return self.length * per_entry

    # -- transformers Cache protocol --------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states``/``value_states`` ``[1, kv_heads, n, head_dim]`` as pending entries.

        Returns the committed + pending keys and values, ``[1, kv_heads, length + n, head_dim]``
        (views into the buffers).
        """
        n = key_states.shape[2]
        end = self.length + n
        if end > self.capacity:
            self.reserve(end)
        self.keys[layer_idx][:, :, self.length:end].copy_(key_states)
        self.values[layer_idx][:, :, self.length:end].copy_(value_states)
        self.pending = n
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def __len__(self) -> int:
        return self.num_layers

    # -- engine operations -------------------------------------------------------------------
    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        """Copy entries at slots ``src`` (``[m]``) to slots ``dst .. dst+m-1`` in every buffer."""
        m = src.shape[0]
        for buf in self.keys + self.values:
            buf[:, :, dst:dst + m] = buf.index_select(2, src)
