"""ZipCache's store (He et al., 2024): mixed precision by token saliency, behind KIVI's full-precision
window of recent entries (:class:`~speculum.cache.window.WindowKVCache`).

A chunk (the prompt's quantized part at prefill, then each group of ``group`` tokens leaving the
window) stores, per layer and KV head, its ``round((1 - ratio) * t)`` most salient tokens at
``hi_bits`` and the others at ``lo_bits``. Keys are quantized channel-wise (one minimum and step per
channel over the part's tokens); values channel-separable token-wise (each channel divided by the
square root of its largest magnitude over the chunk, then one minimum and step per token). Tokens
keep their slots: reads scatter both parts back into position order.

Saliency is given for the prompt (the policy's probe queries) and computed here for later groups by
:func:`local_saliency`: the group's own queries (the window keeps them, :attr:`keeps_queries`) are the
probes, so a group's precision depends on nothing but its tokens and is the same for any step grouping.

Reading (:meth:`MixedKVCache.read`): where the KV kernels are built and read the parts' codes
(``zip_attend``, :mod:`speculum.cache.kernels`), each part is read from its codes where it is stored,
under one softmax with the window, nothing dequantized; attention does not depend on the order of
its keys, so the parts need no scattering back into slot order (only where a mask hides some of the
store's slots, or a sliding layer's read starts inside a chunk, do the kernels map each token to its
slot through the chunk's ``salient`` flags). Elsewhere (off a CPU, 8-bit parts) a layer is decoded
and attended in torch, which gives the same result to float rounding.

Example (ratio 0.4, group 32): each later group keeps 19 tokens per head at 4 bits and 13 at 2 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionLayout
from .kernels import kernels_for, mask3
from .quantized import decode_keys, decode_values, encode_keys, encode_values
from .window import WindowKVCache


def local_saliency(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None,
                   window: int | None) -> torch.Tensor:
    """ZipCache's normalized attention with a group's own queries as probes: ``q [G, H, d]`` of the
    group's tokens over their keys ``k [H_kv, G, d]`` (causal, within ``window``); each key's
    attention summed over the queries that see it (and the query heads of its KV group), divided by
    their number -> ``[H_kv, G]`` float32."""
    G, heads = q.shape[:2]
    kv_heads = k.shape[0]
    qg = q.unflatten(1, (kv_heads, heads // kv_heads)).permute(1, 2, 0, 3)  # [H_kv, g, G, d]
    scores = torch.matmul(qg, k[:, None].transpose(-1, -2)).float() * scale  # [H_kv, g, G, G]
    if softcap is not None:
        scores = (scores / softcap).tanh() * softcap
    i = torch.arange(G, device=q.device)
    vis = i[None, :] <= i[:, None]
    if window is not None:
        vis &= i[None, :] > i[:, None] - window
    probs = scores.masked_fill(~vis, float("-inf")).softmax(-1)
    return probs.sum((1, 2)) / vis.sum(0)


@dataclass
class Part:
    """One precision's tokens of a chunk (``k`` per head, in slot order), every layer."""

    bits: int
    kc: torch.Tensor  # [layers, H_kv, k, d*bits/8] uint8 key codes
    klo: torch.Tensor  # [layers, H_kv, 1, d] float16 per-channel minimum over the part
    kstep: torch.Tensor  # [layers, H_kv, 1, d] float16
    vc: torch.Tensor  # [layers, H_kv, k, d*bits/8] uint8 value codes (channels scaled)
    vlo: torch.Tensor  # [layers, H_kv, k, 1] float16 per-token minimum
    vstep: torch.Tensor  # [layers, H_kv, k, 1] float16


@dataclass
class MixedChunk:
    """One compressed chunk of slots ``start .. start+t-1``, every layer."""

    start: int
    salient: torch.Tensor  # [layers, H_kv, t] bool: stored at hi_bits
    vscale: torch.Tensor  # [layers, H_kv, d] float16 value channel scales
    parts: list[Part | None]  # [hi, lo]; None where a precision holds no token

    @property
    def end(self) -> int:
        return self.start + self.salient.shape[-1]

    def nbytes(self) -> int:
        tensors = [self.salient, self.vscale] + [t for p in self.parts if p is not None
                                                 for t in (p.kc, p.klo, p.kstep, p.vc, p.vlo, p.vstep)]
        return sum(t.numel() * t.element_size() for t in tensors)


def split_order(salient: torch.Tensor) -> torch.Tensor:
    """Slots ``[..., t]``: the salient ones first, then the others, each in slot order."""
    return torch.sort((~salient).to(torch.uint8), dim=-1, stable=True).indices


class MixedKVCache(WindowKVCache):
    """Salient tokens at ``hi_bits``, the others (a fraction ``ratio`` of each chunk) at ``lo_bits``."""

    keeps_queries = True

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, group: int,
                 residual: int, hi_bits: int, lo_bits: int, ratio: float):
        super().__init__(layout, dtype, device, capacity_hint, group, residual)
        self.bits, self.ratio = (hi_bits, lo_bits), ratio
        self.chunks: list[MixedChunk] = []

    # -- one chunk ------------------------------------------------------------------------------------
    def encode(self, keys: torch.Tensor, values: torch.Tensor, saliency: torch.Tensor) -> MixedChunk:
        """``keys, values [H_kv, t, d]`` of one layer with ``saliency [H_kv, t]`` -> a one-layer chunk
        (leading layer axis of size 1, ``start`` unset)."""
        t, d = keys.shape[-2:]
        hi = round((1 - self.ratio) * t)
        salient = torch.zeros(saliency.shape, dtype=torch.bool, device=keys.device)
        salient.scatter_(-1, saliency.topk(hi, dim=-1).indices, True)
        order = split_order(salient)
        vscale = values.float().abs().amax(-2).sqrt().clamp_min(1e-4).half()  # [H, d]
        scaled = values.float() / vscale.float()[:, None, :]
        parts: list[Part | None] = []
        for idx, bits in ((order[:, :hi], self.bits[0]), (order[:, hi:], self.bits[1])):
            if idx.shape[-1] == 0:
                parts.append(None)
                continue
            rows = idx[..., None].expand(-1, -1, d)
            kenc = encode_keys(keys.gather(1, rows), bits, idx.shape[-1])
            venc = encode_values(scaled.gather(1, rows), bits, d)
            parts.append(Part(bits, *(x[None] for x in kenc + venc)))
        return MixedChunk(-1, salient[None], vscale[None], parts)

    def decode(self, chunk: MixedChunk, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[H_kv, t, d]`` (float32, slot order) of ``chunk``'s ``layer``."""
        salient = chunk.salient[layer]
        order = split_order(salient)
        heads, t = salient.shape
        d = chunk.vscale.shape[-1]
        keys = torch.empty((heads, t, d), dtype=torch.float32, device=salient.device)
        values = torch.empty_like(keys)
        at = 0
        for p in chunk.parts:
            if p is None:
                continue
            k = p.kc.shape[2]
            idx = order[:, at:at + k, None].expand(-1, -1, d)
            keys.scatter_(1, idx, decode_keys(p.kc[layer], p.klo[layer], p.kstep[layer], p.bits, k))
            values.scatter_(1, idx, decode_values(p.vc[layer], p.vlo[layer], p.vstep[layer], p.bits, d))
            at += k
        return keys, values * chunk.vscale[layer].float()[:, None, :]

    def saliency(self, layer: int, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """A later group's saliency ``[H_kv, G]`` from its queries (:func:`local_saliency`)."""
        s = self.layout
        return local_saliency(queries, keys, s.scale, s.softcap, s.window if s.is_sliding(layer) else None)

    # -- the store ------------------------------------------------------------------------------------
    def store_chunk(self, layer: int, keys: torch.Tensor, values: torch.Tensor, saliency: torch.Tensor,
                    at: int | None = None) -> None:
        """Compress ``keys, values [H_kv, t, d]`` of ``layer`` with ``saliency [H_kv, t]`` as the chunk at
        slots ``at ..`` (default ``tq``; made for every layer when the first one is stored)."""
        at = self.tq if at is None else at
        one = self.encode(keys, values, saliency)
        chunk = self.chunks[-1] if self.chunks and self.chunks[-1].start == at else None
        if chunk is None:
            grow = lambda x: x.new_zeros((self.layout.layers,) + x.shape[1:])
            chunk = MixedChunk(at, grow(one.salient), grow(one.vscale),
                               [None if p is None else Part(p.bits, *(grow(getattr(p, f)) for f in
                                                                       ("kc", "klo", "kstep", "vc", "vlo", "vstep")))
                                for p in one.parts])
            self.chunks.append(chunk)
        chunk.salient[layer], chunk.vscale[layer] = one.salient[0], one.vscale[0]
        for mine, new in zip(chunk.parts, one.parts):
            if new is not None:
                for f in ("kc", "klo", "kstep", "vc", "vlo", "vstep"):
                    getattr(mine, f)[layer] = getattr(new, f)[0]

    def store_block(self, keys, values, queries) -> None:
        G = self.group
        for i in range(0, keys.shape[-2], G):  # one chunk per group, saliency from its own queries
            for layer in range(self.layout.layers):
                k, v = keys[layer, :, i:i + G], values[layer, :, i:i + G]
                self.store_chunk(layer, k, v, self.saliency(layer, k, queries[layer, i:i + G]), at=self.tq + i)

    def dequantized(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.decode(c, layer) for c in self.chunks if c.end > start and c.start < self.tq]
        first = next(c.start for c in self.chunks if c.end > start)
        keys = torch.cat([p[0] for p in parts], dim=1)[:, start - first:]
        values = torch.cat([p[1] for p in parts], dim=1)[:, start - first:]
        return keys.to(self.dtype), values.to(self.dtype)

    def kernel_reads(self, ops) -> bool:
        """Whether the kernels ``ops`` read this store's parts: ``zip_attend`` built, both precisions' runs of
        ``d`` codes in a layout the build reads (2 or 4 bits)."""
        return hasattr(ops, "zip_attend") and all(ops.reads_packed(self.layout.head_dim, b) for b in self.bits)

    def part_operands(self, start: int) -> tuple[list[torch.Tensor], list[int]]:
        """The parts of the chunks holding slots ``start .. tq-1`` as ``zip_attend`` takes them (every layer's
        tensors; the call picks one): 8 tensors and 3 numbers (bits, chunk's first slot, salient) a part."""
        tensors: list[torch.Tensor] = []
        meta: list[int] = []
        for c in self.chunks:
            if c.end <= start or c.start >= self.tq:
                continue
            for salient, part in zip((1, 0), c.parts):
                if part is not None:
                    tensors += [part.kc, part.klo, part.kstep, part.vc, part.vlo, part.vstep, c.vscale, c.salient]
                    meta += [part.bits, c.start, salient]
        return tensors, meta

    def read(self, layer: int, q: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor,
             visible: torch.Tensor | None) -> torch.Tensor:
        """:meth:`WindowKVCache.read <speculum.cache.window.WindowKVCache.read>` on the parts' codes as stored
        (``zip_attend``), where the kernels are built and read them; else decoded and attended in torch."""
        s = self.layout
        ops = kernels_for(q, s.head_dim)
        if ops is None or not self.kernel_reads(ops):
            return super().read(layer, q, start, keys, values, visible)
        tensors, meta = self.part_operands(start)
        return ops.zip_attend(q, tensors, meta, layer, start, self.tq, keys, values, mask3(visible), s.scale,
                              s.softcap or 0.0)

    def roundtrip(self, layer, keys, values, queries):
        one = self.encode(keys, values, self.saliency(layer, keys, queries))
        k, v = self.decode(one, 0)
        return k.to(self.dtype), v.to(self.dtype)

    def store_nbytes(self) -> int:
        """Every chunk's codes, minima and steps, value scales and saliency flags."""
        return sum(c.nbytes() for c in self.chunks)
