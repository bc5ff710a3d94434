"""The base of every KV cache the engine uses: committed and pending entries, growth, commit of an
accepted path, rollback and byte counts.

A forward pass writes its ``n`` new entries in place after the ``length`` committed ones; they stay
*pending* until :meth:`KVCache.commit` keeps the root and the accepted path of the draft tree (or,
after a prefill chunk, all of them). Rejected entries are simply overwritten by the next forward.
:meth:`KVCache.rollback` shortens the committed length.

A subclass owns its buffers: it says how many entries they hold (:attr:`capacity`), how to add
room (:meth:`_grow`), how to move entries inside them (:meth:`_move_entries`) and what one
committed entry costs in bytes (:meth:`entry_bytes`). Everything else is here.
"""

from __future__ import annotations

import torch


class KVCache:
    """Commit / rollback bookkeeping, growth by doubling and byte counts.

    Attributes:
        length: committed entries (slots ``0 .. length-1``).
        pending: entries written by the last forward after ``length``, not yet committed.
        peak_bytes: the most bytes the committed entries held at any commit.
        state: the KV policy's per-request state (a dataclass of the policy's; None without one).
    """

    device: torch.device

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.length = 0
        self.pending = 0
        self.peak_bytes = 0
        self.state: object | None = None

    # -- what a subclass provides ------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Entries the buffers hold now (committed, pending and free)."""
        raise NotImplementedError

    def _growth_unit(self) -> int:
        """The least number of entries a growth adds: the growable buffer's current size, so that
        growth doubles it and costs amortised O(1) copies per entry."""
        return self.capacity

    def _grow(self, extra: int) -> None:
        """Reallocate the buffers with ``extra`` more entries, keeping the committed ones."""
        raise NotImplementedError

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        """Copy the entries at slots ``src [m]`` to slots ``dst .. dst+m-1``."""
        raise NotImplementedError

    def entry_bytes(self) -> int:
        """Bytes one committed entry costs across all layers (keys and values)."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The rotary position of the next token (``length`` unless a policy evicted entries)."""
        return self.length

    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` entries (grows by doubling, keeps the committed ones)."""
        short = capacity - self.capacity
        if short > 0:
            self._grow(max(short, self._growth_unit()))

    def begin(self, positions: torch.Tensor) -> None:
        """Before a forward writes entries for new tokens at ``positions [n]``: make room for them."""
        self.reserve(self.length + positions.shape[0])

    def nbytes(self) -> int:
        """Bytes of the committed entries (the figure KV policies shrink)."""
        return self.length * self.entry_bytes()

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
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def rollback(self, length: int) -> None:
        """Drop committed entries past ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length
        self.pending = 0
