"""A cache whose KV heads keep different entries: some heads every entry, others only attention
sinks and a recent window (DuoAttention's retrieval and streaming heads; sliding-window layers).

The heads are split into *groups*. A group holds some KV heads of some layers in one buffer
``kv [2, G, C, d]`` (one layer's heads adjacent along ``G``) and the positions its slots hold,
``pos [C]``, the same for all its heads:

- a *full* group (``window`` None) keeps every entry: slot ``c`` holds position ``c``;
- a *window* group keeps its first ``sinks`` entries and the ``window`` most recent ones. New
  entries are appended; once ``slack`` more have come, one copy moves the most recent ``window``
  back behind the sinks (:meth:`SplitHeadCache.evict`), so what it drops is never allocated again.

What a head's query at position ``p`` sees: in a full group every committed entry; in a window
group the keys at positions ``< sinks`` or ``> p - window`` (:func:`~speculum.attention.sinks_or_window`;
``sinks`` 0 is the sliding-window rule), both along with the new entries the step's mask shows it.
The rule depends on ``p`` alone, so a tree step's rows see exactly what one-token steps at their
positions see, and the slots a window group keeps are never fewer than that needs.

Example: ``sinks=2, window=4``, 12 committed tokens ``t0 .. t11``: a window group holds ``t0 t1``
and at least ``t8 .. t11``; a query at position 12 sees ``t0 t1 t9 t10 t11`` and itself.

Pending entries (a forward's) go after each group's committed ones and are committed or dropped
as in every cache of the engine (:class:`~speculum.cache.base.KVCache`); ``length`` counts the
committed tokens, which the full groups hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionLayout, Step, attention, grouped, sinks_or_window, visibility
from .base import KVCache
from .store import put


@dataclass(frozen=True)
class GroupSpec:
    """Which KV heads a group holds and what it keeps of them."""

    heads: tuple[tuple[int, ...], ...]  # per layer: the KV heads of that layer in this group (increasing)
    sinks: int = 0
    window: int | None = None  # None: every entry

    def keeps(self, n: int) -> torch.Tensor | None:
        """Which of ``n`` prompt entries the group keeps, ``[m]`` increasing (None: all of them)."""
        if self.window is None or n <= self.sinks + self.window:
            return None
        return torch.cat([torch.arange(self.sinks), torch.arange(n - self.window, n)])


class HeadGroup:
    """One group's storage: ``kv [2, G, C, d]``, ``pos [C]`` and ``used`` committed slots."""

    def __init__(self, spec: GroupSpec, head_dim: int, capacity: int, dtype: torch.dtype, device):
        self.spec = spec
        rows = sum(len(h) for h in spec.heads)
        # zeros: attention may span unwritten slots only masked, so they must hold finite numbers
        self.kv = torch.zeros((2, rows, capacity, head_dim), dtype=dtype, device=device)
        self.pos = torch.zeros(capacity, dtype=torch.long, device=device)
        self.used = 0

    @property
    def slack(self) -> int:
        """Entries a window group takes past sinks + window before :meth:`evict` copies them back."""
        return max(16, (self.spec.sinks + (self.spec.window or 0)) // 16)

    def reserve(self, slots: int) -> None:
        """Room for ``slots`` entries (doubling, committed ones kept)."""
        cap = self.kv.shape[2]
        if slots <= cap:
            return
        size = max(slots, 2 * cap)
        kv = self.kv.new_zeros((*self.kv.shape[:2], size, self.kv.shape[3]))
        kv[:, :, : self.used] = self.kv[:, :, : self.used]
        pos = self.pos.new_zeros(size)
        pos[: self.used] = self.pos[: self.used]
        self.kv, self.pos = kv, pos

    def evict(self) -> None:
        """A window group past sinks + window + slack: the most recent ``window`` entries move back
        behind the sinks (one copy for every head)."""
        s, w = self.spec.sinks, self.spec.window
        if w is None or self.used <= s + w + self.slack:
            return
        self.kv[:, :, s:s + w] = self.kv[:, :, self.used - w: self.used].clone()
        self.pos[s:s + w] = self.pos[self.used - w: self.used].clone()
        self.used = s + w

    def visible(self, step: Step) -> torch.Tensor | None:
        """Bool ``[n, used + n]``: which of the committed and new entries each new row sees (None: all)."""
        n, s = step.n, self.spec
        full = visibility(self.used, step.positions, step.new_mask, None)[0]
        if s.window is None:
            return full
        keys = torch.cat([self.pos[: self.used], step.positions])
        vis = sinks_or_window(keys, step.positions, s.sinks, s.window)
        vis = vis if full is None else vis & full
        return None if n == 1 and bool(vis.all()) else vis

    def entry_bytes(self) -> int:
        """Bytes of one entry of every head (keys and values)."""
        _, rows, _, d = self.kv.shape
        return 2 * rows * d * self.kv.element_size()

    def nbytes(self) -> int:
        return self.used * self.entry_bytes()


@dataclass(frozen=True)
class LayerPart:
    """One layer's heads in one group."""

    group: int  # index in SplitHeadCache.groups
    rows: slice  # their rows in the group's buffer
    kv_heads: torch.Tensor | None  # [h] the layer's KV heads in this part (None: all of them, in order)
    q_heads: torch.Tensor | None  # [h*g] the query heads they serve (None: all)


class SplitHeadCache(KVCache):
    """KV heads split into groups that keep different entries (module docstring).

    Made empty by :meth:`__init__`; :meth:`allocate` gives it its groups once the prompt's length is
    known (the split may depend on it), :meth:`store_layer` its prompt entries.

    Attributes:
        groups: the :class:`HeadGroup` s.
        parts: per layer, its :class:`LayerPart` s (together, each of its KV heads once).
        capacity_hint: prompt + new tokens + draft nodes, as the engine asked.
    """

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int):
        super().__init__(device)
        self.layout, self.dtype, self.capacity_hint = layout, dtype, capacity_hint
        self.groups: list[HeadGroup] = []
        self.parts: list[list[LayerPart]] = [[] for _ in range(layout.layers)]
        self._masks: dict[int, torch.Tensor | None] = {}
        self._mask_step: Step | None = None

    # -- layout of the groups --------------------------------------------------------------------
    def allocate(self, specs: list[GroupSpec], n: int) -> None:
        """Groups for ``specs`` (together, every KV head of every layer once) before ``n`` prompt entries."""
        s = self.layout
        growth = max(self.capacity_hint - n, 1)
        covered = [[] for _ in range(s.layers)]
        for gi, spec in enumerate(specs):
            keep = spec.keeps(n)
            m = n if keep is None else keep.shape[0]
            room = m + (growth if spec.window is None else min(growth, 128 + max(16, m // 16)))
            group = HeadGroup(spec, s.head_dim, room, self.dtype, self.device)
            self.groups.append(group)
            row = 0
            for layer, heads in enumerate(spec.heads):
                if not heads:
                    continue
                covered[layer] += heads
                kv_heads = None if list(heads) == list(range(s.kv_heads)) else torch.tensor(heads, device=self.device)
                q_heads = None if kv_heads is None else (
                    kv_heads[:, None] * s.group + torch.arange(s.group, device=self.device)).flatten()
                self.parts[layer].append(LayerPart(gi, slice(row, row + len(heads)), kv_heads, q_heads))
                row += len(heads)
        if any(sorted(c) != list(range(s.kv_heads)) for c in covered):
            raise ValueError("the groups must hold every KV head of every layer exactly once")

    def store_layer(self, layer: int, kv: torch.Tensor) -> None:
        """One layer's prompt entries ``kv [2, H_kv, n, d]``: each group keeps what its spec says."""
        n = kv.shape[2]
        for part in self.parts[layer]:
            group = self.groups[part.group]
            keep = group.spec.keeps(n)
            src = kv if part.kv_heads is None else kv.index_select(1, part.kv_heads)
            if keep is not None:
                src = src.index_select(2, keep.to(kv.device))
            group.kv[:, part.rows, : src.shape[2]] = src

    def end_prompt(self, n: int) -> None:
        """After every layer's :meth:`store_layer`: ``n`` prompt tokens committed."""
        for group in self.groups:
            keep = group.spec.keeps(n)
            pos = torch.arange(n, device=self.device) if keep is None else keep.to(self.device)
            group.used = pos.shape[0]
            group.pos[: group.used] = pos
        self.length = n
        self.peak_bytes = self.nbytes()

    # -- the cache's protocol --------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Tokens the groups have room for without growing (committed and new)."""
        return self.length + min((g.kv.shape[2] - g.used for g in self.groups), default=0)

    def reserve(self, capacity: int) -> None:
        for g in self.groups:
            g.reserve(g.used + capacity - self.length)

    def begin(self, positions: torch.Tensor) -> None:
        n = positions.shape[0]
        for g in self.groups:
            g.reserve(g.used + n)
            g.pos[g.used: g.used + n] = positions

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        for g in self.groups:  # src, dst count tokens; a group's pending block starts at its own ``used``
            at = g.used - self.length
            g.kv[:, :, dst + at: dst + at + src.shape[0]] = g.kv.index_select(2, src + at)
            g.pos[dst + at: dst + at + src.shape[0]] = g.pos.index_select(0, src + at)

    def commit(self, keep: list[int] | None = None) -> None:
        before = self.length
        super().commit(keep)
        for g in self.groups:
            g.used += self.length - before
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def rollback(self, length: int) -> None:
        super().rollback(length)
        for g in self.groups:  # positions increase along a group's slots
            g.used = int((g.pos[: g.used] < length).sum())

    def evict(self) -> None:
        """Window groups drop what lies beyond sinks + window (after a commit)."""
        for g in self.groups:
            g.evict()

    def nbytes(self) -> int:
        return sum(g.nbytes() for g in self.groups)

    def entry_bytes(self) -> int:
        """Bytes one more committed token costs in the full groups (window groups stop growing)."""
        return sum(g.entry_bytes() for g in self.groups if g.spec.window is None)

    # -- attention -------------------------------------------------------------------------------
    def _mask(self, gi: int, step: Step) -> torch.Tensor | None:
        """Group ``gi``'s additive folded mask for this step (built once per step, shared by the layers)."""
        if self._mask_step is not step:
            self._mask_step, self._masks = step, {}
        if gi not in self._masks:
            self._masks[gi] = grouped(self.groups[gi].visible(step), self.layout.group, self.dtype)
        return self._masks[gi]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """Write ``k, v [n, H_kv, d]`` into each part's group and attend ``q [n, H, d]`` -> ``[n, H*d]``:
        each head over what its group holds, under its group's rule."""
        s, n = self.layout, step.n
        outs = []
        for part in self.parts[layer]:
            g = self.groups[part.group]
            kp = k if part.kv_heads is None else k.index_select(1, part.kv_heads)
            vp = v if part.kv_heads is None else v.index_select(1, part.kv_heads)
            qp = q if part.q_heads is None else q.index_select(1, part.q_heads)
            kv = g.kv[:, part.rows]
            put(kv, g.used, kp, vp)
            end = g.used + n
            outs.append(attention(qp, kv[0, :, :end], kv[1, :, :end], self._mask(part.group, step), s.scale, s.softcap))
        return self._combine(layer, outs, q)

    def prompt_attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, a: int, b: int,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """Prompt rows ``a .. b-1`` (``q [b-a, H, d]``) of one layer over its prompt entries so far,
        ``kv [2, H_kv, >= b, d]``, each head under its group's rule (the layer-by-layer prefill's
        attention): a full group's heads under ``mask`` (the prefill's causal one, folded ``[g*(b-a), b]``),
        a window group's over its sinks and the window behind each row only."""
        s = self.layout
        positions = torch.arange(a, b, device=q.device)
        outs = []
        for part in self.parts[layer]:
            spec = self.groups[part.group].spec
            qp = q if part.q_heads is None else q.index_select(1, part.q_heads)
            kvp = kv[:, :, :b] if part.kv_heads is None else kv[:, :, :b].index_select(1, part.kv_heads)
            part_mask = mask
            if spec.window is not None:
                keys = torch.arange(b, device=q.device)
                keys = keys[(keys < spec.sinks) | (keys > a - spec.window)]  # [L] the keys any row sees
                kvp = kvp.index_select(2, keys)
                vis = sinks_or_window(keys, positions, spec.sinks, spec.window) & (keys[None, :] <= positions[:, None])
                part_mask = grouped(vis, s.group, kv.dtype)
            outs.append(attention(qp, kvp[0], kvp[1], part_mask, s.scale, s.softcap))
        return self._combine(layer, outs, q)

    def _combine(self, layer: int, outs: list[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
        """The parts' outputs (``[n, h*g*d]`` each) into the layer's head order: ``[n, H*d]``."""
        parts = self.parts[layer]
        if len(parts) == 1 and parts[0].q_heads is None:
            return outs[0]
        n, heads, d = q.shape
        out = q.new_empty((n, heads, d))
        for part, o in zip(parts, outs):
            out[:, part.q_heads] = o.view(n, -1, d)
        return out.view(n, heads * d)
