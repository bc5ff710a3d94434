"""A compressed store plus a full-precision window of recent entries: the layout KIVI introduced,
shared by the caches that compress every token (KIVI, GEAR, ZipCache).

Slots ``0 .. tq-1`` live in a compressed *store*, in whole groups of ``group`` tokens; the most recent
entries (at least ``residual``, fewer than ``residual + group``) stay in the model's dtype in the
*residual window*, where a forward's pending entries are written and committed.
:meth:`WindowKVCache.flush` moves whole groups into the store after each commit, so that after any
commit at length ``L`` the store holds ``quantized_at(L) = max(0, (L - residual) // group * group)``
entries, whatever steps led there. A subclass says how groups are compressed (:meth:`store_block`,
:meth:`roundtrip`) and read back (:meth:`dequantized`).

Step invariance. A one-token step at position ``p`` reads a store of ``quantized_at(p)`` entries. A
step of several rows at length ``L`` (a prefill chunk, a draft chain, a tree) has rows at positions
``p >= L``; a row whose ``quantized_at(p)`` passes the store's ``tq`` reads the groups in between
as the store would give them back (a :class:`GroupView`: compressed and decompressed on the spot,
from the row's own path where a group reaches into the step's pending entries) instead of the
full-precision entries they replace. So each row of a tree reads what a one-token step at its
position reads, and speculation through a lossy store keeps plain decoding's output through it.

Example (group 4, residual 4): at length 10 the store holds slots 0-3 and the window 4-9. A chain
step feeds the root and three drafts at positions 10-13: rows 10 and 11 read slots 4-9 in full
precision (``quantized_at`` is 4 there), rows 12 and 13 read slots 4-7 as group ``[4, 8)`` compressed
and decompressed (``quantized_at`` is 8 there), then 8-9 and their ancestors in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionLayout, Step, attention, grouped, in_window, visibility, window_start
from .base import KVCache
from .store import put


@dataclass
class GroupView:
    """A group of the residual window that some rows of a step read compressed."""

    start: int  # position of the group's first entry
    slots: torch.Tensor  # [group] window slots holding its entries (pending ones at r + row)
    rows: torch.Tensor  # [n] bool: the step's rows that read it


class WindowKVCache(KVCache):
    """Compressed store for slots ``0 .. tq-1`` + full-precision residual window for the rest.

    Attributes:
        tq: entries in the store (a multiple of ``group``); the window holds slots ``tq .. length-1``
            (and the pending ones).
        resid: ``[layers, 2, H_kv, R_cap, d]`` the window's keys and values in the model's dtype.
        qres: ``[layers, R_cap, H, d]`` the window's queries, where :attr:`keeps_queries` (a store
            whose compression reads them: ZipCache's saliency); None elsewhere.
    """

    keeps_queries = False

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, group: int,
                 residual: int):
        super().__init__(device)
        s = layout
        self.layout, self.dtype = layout, dtype
        self.group, self.residual = group, residual
        self.capacity_hint = capacity_hint
        self.tq = 0
        self.resid = torch.empty((s.layers, 2, s.kv_heads, 0, s.head_dim), dtype=dtype, device=self.device)
        self.qres = (torch.empty((s.layers, 0, s.heads, s.head_dim), dtype=dtype, device=self.device)
                     if self.keeps_queries else None)
        self._views: tuple[Step | None, list[GroupView], torch.Tensor | None] = (None, [], None)

    @property
    def r(self) -> int:
        """Committed entries in the residual window."""
        return self.length - self.tq

    def quantized_at(self, length: int) -> int:
        """Entries in the store after a commit at ``length``."""
        return max(0, (length - self.residual) // self.group * self.group)

    # -- what a store provides -----------------------------------------------------------------
    def allocate(self, tokens: int) -> None:
        """The store, for up to ``tokens`` entries (called once, before prefill)."""

    def store_block(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Compress ``keys, values [layers, H_kv, t, d]`` (``t`` whole groups; ``queries [layers, t, H, d]``
        where kept) into the store's slots ``tq ..`` of every layer."""
        raise NotImplementedError

    def dequantized(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[H_kv, tq - start, d]`` of the store's slots ``start .. tq-1`` (``start`` a
        multiple of ``group``), in the model's dtype."""
        raise NotImplementedError

    def roundtrip(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                  queries: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """What storing one group ``keys, values [H_kv, group, d]`` of ``layer`` (``queries [group, H, d]``
        where kept) and reading it back gives, in the model's dtype, without storing it."""
        raise NotImplementedError

    def store_nbytes(self) -> int:
        """Bytes the store holds for its ``tq`` entries."""
        raise NotImplementedError

    # -- KVCache -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.tq + self.resid.shape[3]

    def _growth_unit(self) -> int:
        return self.resid.shape[3]  # the window doubles; the store is allocated once

    def _grow(self, extra: int) -> None:
        shape = list(self.resid.shape)
        shape[3] += extra
        new = torch.empty(shape, dtype=self.dtype, device=self.device)
        new[:, :, :, : self.r] = self.resid[:, :, :, : self.r]
        self.resid = new
        if self.qres is not None:
            q = self.qres.new_empty((self.qres.shape[0], shape[3], *self.qres.shape[2:]))
            q[:, : self.r] = self.qres[:, : self.r]
            self.qres = q

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        m, at = src.shape[0], dst - self.tq
        self.resid[:, :, :, at:at + m] = self.resid.index_select(3, src - self.tq)
        if self.qres is not None:
            self.qres[:, at:at + m] = self.qres.index_select(1, src - self.tq)

    def entry_bytes(self) -> int:
        s = self.layout
        per = s.layers * s.kv_heads * 2 * s.head_dim * self.resid.element_size()
        return per + (0 if self.qres is None else s.layers * s.heads * s.head_dim * self.qres.element_size())

    def nbytes(self) -> int:
        """Bytes held: the store and the residual window (with its queries where kept)."""
        return self.store_nbytes() + self.r * self.entry_bytes()

    # -- the window ------------------------------------------------------------------------------
    @torch.inference_mode()
    def flush(self) -> None:
        """Move whole groups out of the residual window into the store (all layers)."""
        t = self.quantized_at(self.length) - self.tq
        if t <= 0:
            return
        block = self.resid[:, :, :, :t]
        self.store_block(block[:, 0], block[:, 1], None if self.qres is None else self.qres[:, :t])
        self.tq += t
        r = self.r
        self.resid[:, :, :, :r] = self.resid[:, :, :, t:r + t].clone()
        if self.qres is not None:
            self.qres[:, :r] = self.qres[:, t:r + t].clone()

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: Step) -> torch.Tensor:
        """Write the new entries ``k, v [n, H_kv, d]`` into the residual window and attend ``q [n, H, d]``
        over the store (from the first group a sliding layer still sees), the groups some rows read
        compressed (:class:`GroupView`) and the window."""
        n, r, s = k.shape[0], self.r, self.layout
        put(self.resid[layer], r, k, v)
        if self.qres is not None:
            self.qres[layer, r:r + n] = q
        window = s.window if sliding else None
        start = min(window_start(step.positions, window), self.tq) // self.group * self.group
        keys, values = self.resid[layer, 0, :, : r + n], self.resid[layer, 1, :, : r + n]
        views, cover = self.views(step)
        if not views:
            return self.read(layer, q, start, keys, values,
                             visibility(self.length, step.positions, step.new_mask, window, start)[1])
        parts = [self.roundtrip(layer, self.resid[layer, 0, :, v.slots], self.resid[layer, 1, :, v.slots],
                                None if self.qres is None else self.qres[layer, v.slots]) for v in views]
        keys = torch.cat([p[0] for p in parts] + [keys], dim=1)
        values = torch.cat([p[1] for p in parts] + [values], dim=1)
        return self.read(layer, q, start, keys, values, self.view_mask(views, cover, step, window, start))

    def read(self, layer: int, q: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor,
             visible: torch.Tensor | None) -> torch.Tensor:
        """The one read of a step: ``q [n, H, d]`` over the store's slots ``start .. tq-1``, decompressed,
        followed by the full-precision ``keys, values [H_kv, m, d]``, the rows seeing the columns where
        ``visible`` (bool ``[n, tq - start + m]``, or None: all) is True -> ``[n, H*d]``. Here in torch
        (dequantize, attend); KIVI's store reads its codes in place instead
        (:meth:`~speculum.cache.QuantKVCache.read`)."""
        if start < self.tq:
            dk, dv = self.dequantized(layer, start)
            keys, values = torch.cat([dk, keys], dim=1), torch.cat([dv, values], dim=1)
        mask = grouped(visible, self.layout.group, self.dtype)
        return attention(q, keys, values, mask, self.layout.scale, self.layout.softcap)

    # -- step invariance -----------------------------------------------------------------------------
    def views(self, step: Step) -> tuple[list[GroupView], torch.Tensor | None]:
        """The groups this step's rows read compressed beyond the store, and ``cover [n]``: the first
        position each row reads in full precision (None without views). Computed once per forward.

        Row ``i`` at position ``p`` reads the groups below ``quantized_at(p)`` compressed. A group past
        the committed entries (a step deeper than ``residual``) is read from the row's own path: one
        view per path node at the group's last position. A row without such a node (a drafter's
        prompt rows, whose positions skip) reads from that group on in full precision."""
        if self._views[0] is step:
            return self._views[1], self._views[2]
        pos, G, L, tq = step.positions, self.group, self.length, self.tq
        cover = ((pos - self.residual).clamp(min=0) // G * G).clamp(min=tq)  # [n]
        views: list[GroupView] = []
        if int(cover.max()) > tq:
            n = step.n
            anc = step.new_mask if step.new_mask is not None else torch.ones(n, n, dtype=torch.bool,
                                                                               device=pos.device).tril()
            anc = anc.to(pos.device)
            for g0 in range(tq, int(cover.max()), G):
                end = g0 + G
                rows = cover >= end
                committed = torch.arange(g0, max(g0, min(end, L)), device=pos.device) - tq
                if end <= L:
                    views.append(GroupView(g0, committed, rows))
                    continue
                served = torch.zeros_like(rows)
                for j in (pos == end - 1).nonzero().flatten().tolist():
                    users = rows & anc[:, j]
                    path = (anc[j] & (pos >= max(g0, L))).nonzero().flatten()
                    path = path[pos[path].argsort()]
                    if path.numel() != end - max(g0, L) or not bool(users.any()):
                        continue
                    views.append(GroupView(g0, torch.cat([committed, self.r + path]), users))
                    served |= users
                cover = torch.where(rows & ~served, torch.full_like(cover, g0), cover)
        self._views = (step, views, cover if views else None)
        return self._views[1], self._views[2]

    def view_mask(self, views: list[GroupView], cover: torch.Tensor, step: Step, window: int | None,
                  start: int) -> torch.Tensor:
        """Visibility ``[n, tq - start + V*group + r + n]`` of the store's slots ``start ..``, the views,
        the window's committed entries and the pending ones: row ``i`` sees a view if it reads it, and
        the window's entries (committed or its ancestors) from position ``cover[i]`` on."""
        pos, n, dev, G = step.positions, step.n, step.positions.device, self.group
        anc = step.new_mask if step.new_mask is not None else torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        committed = torch.arange(self.tq, self.length, device=dev)
        vis = torch.cat([torch.ones(n, self.tq - start, dtype=torch.bool, device=dev)]
                        + [v.rows[:, None].expand(n, G) for v in views]
                        + [committed[None, :] >= cover[:, None], anc.to(dev) & (pos[None, :] >= cover[:, None])], dim=1)
        if window is not None:
            key_pos = torch.cat([torch.arange(start, self.tq, device=dev)]
                                + [torch.arange(v.start, v.start + G, device=dev) for v in views] + [committed, pos])
            vis &= in_window(key_pos, pos, window)
        return vis
