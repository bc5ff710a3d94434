"""A low-bit KV cache (KIVI: Liu et al., 2024): keys quantized per channel, values per token, with
the most recent entries in full precision.

Keys are quantized per channel (their outliers live in fixed channels), in groups of ``group``
tokens; values per token, in groups of ``Gc = min(group, d)`` channels; 2 or 4 bits with a float16
minimum and step per group, packed several codes to a byte, so the stored bytes really shrink
(4 bits: about 31% of bfloat16 with the default groups). The most recent entries (at least
``residual``, fewer than ``residual + group``) stay in full precision in the *residual window*,
where a forward's pending entries are written and committed; :meth:`QuantKVCache.flush` moves whole
groups out of it into the quantized store.

Attention dequantizes one layer's keys and values at a time: memory at rest shrinks, the bytes
read per step do not (a fused low-bit attention kernel would be needed for that).
"""

from __future__ import annotations

import torch

from ..attention import AttentionLayout, Step, attention, grouped, visibility, window_start
from .base import KVCache
from .store import put


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., d]`` uint8 in ``[0, 2**bits)`` -> ``[..., d * bits / 8]`` uint8, low bits first."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., d * bits / 8]`` -> ``[..., d]`` uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization of ``x`` with one (minimum, step) per slice along ``dim``.

    Returns ``codes`` (uint8, shaped like ``x``), ``lo`` and ``step`` (float16, ``dim`` reduced)."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    step = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    codes = ((xf - lo) / step).round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes, lo.squeeze(dim).half(), step.squeeze(dim).half()


class QuantKVCache(KVCache):
    """Packed low-bit store for slots ``0 .. tq-1`` + full-precision residual window for the rest.

    Attributes (``T`` quantized tokens, a multiple of ``group``; ``G = group``):
        tq: quantized entries; the residual window holds slots ``tq .. length-1`` (and pending ones).
        kcodes, vcodes: ``[layers, H_kv, T_cap, d * bits / 8]`` uint8.
        klo, kstep: ``[layers, H_kv, T_cap / G, d]`` float16 (per channel, per token group).
        vlo, vstep: ``[layers, H_kv, T_cap, d / Gc]`` float16 (per token, per group of channels).
        resid: ``[layers, 2, H_kv, R_cap, d]`` the recent entries in the model's dtype.
    """

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, bits: int,
                 group: int, residual: int):
        super().__init__(device)
        s = layout
        self.cgroup = min(group, s.head_dim)  # value channels per (minimum, step)
        if s.head_dim % self.cgroup:
            raise ValueError(f"head dim {s.head_dim} does not split into groups of {self.cgroup} channels")
        self.layout, self.dtype = layout, dtype
        self.bits, self.group, self.residual = bits, group, residual
        self.capacity_hint = capacity_hint
        self.tq = 0
        self.kcodes = self.vcodes = None
        self.resid = torch.empty((s.layers, 2, s.kv_heads, 0, s.head_dim), dtype=dtype, device=self.device)

    @property
    def r(self) -> int:
        """Committed entries in the residual window."""
        return self.length - self.tq

    def allocate(self, tokens: int) -> None:
        """The quantized store, for up to ``tokens`` entries (rounded up to whole groups)."""
        s, G = self.layout, self.group
        cap = -(-tokens // G) * G
        width = s.head_dim * self.bits // 8
        self.kcodes = torch.empty((s.layers, s.kv_heads, cap, width), dtype=torch.uint8, device=self.device)
        self.vcodes = torch.empty_like(self.kcodes)
        self.klo = torch.empty((s.layers, s.kv_heads, cap // G, s.head_dim), dtype=torch.float16, device=self.device)
        self.kstep = torch.empty_like(self.klo)
        self.vlo = torch.empty((s.layers, s.kv_heads, cap, s.head_dim // self.cgroup), dtype=torch.float16,
                               device=self.device)
        self.vstep = torch.empty_like(self.vlo)

    # -- KVCache -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.tq + self.resid.shape[3]

    def _growth_unit(self) -> int:
        return self.resid.shape[3]  # the residual window doubles; the quantized store is allocated once

    def _grow(self, extra: int) -> None:
        shape = list(self.resid.shape)
        shape[3] += extra
        new = torch.empty(shape, dtype=self.dtype, device=self.device)
        new[:, :, :, : self.r] = self.resid[:, :, :, : self.r]
        self.resid = new

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        m = src.shape[0]
        self.resid[:, :, :, dst - self.tq:dst - self.tq + m] = self.resid.index_select(3, src - self.tq)

    def entry_bytes(self) -> int:
        return self.layout.layers * self.layout.kv_heads * 2 * self.layout.head_dim * self.resid.element_size()

    def nbytes(self) -> int:
        """Bytes held: packed codes, their float16 minima and steps, and the residual window."""
        s, G, t = self.layout, self.group, self.tq
        per_layer_head = (2 * t * s.head_dim * self.bits // 8  # key and value codes
                          + 2 * (t // G) * s.head_dim * 2  # key minima and steps
                          + 2 * t * (s.head_dim // self.cgroup) * 2)  # value minima and steps
        return s.layers * s.kv_heads * per_layer_head + self.r * self.entry_bytes()

    # -- quantized store ---------------------------------------------------------------------------
    def store_quantized(self, layers: slice | int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``keys, values [..., H_kv, t, d]`` (``t`` a multiple of ``group``) into slots ``tq ..``."""
        G, b = self.group, self.bits
        t, d = keys.shape[-2], keys.shape[-1]
        a = self.tq
        kc, klo, kstep = quantize(keys.unflatten(-2, (t // G, G)), b, dim=-2)  # per channel over G tokens
        self.kcodes[layers, :, a:a + t] = pack(kc.flatten(-3, -2), b)
        self.klo[layers, :, a // G:(a + t) // G], self.kstep[layers, :, a // G:(a + t) // G] = klo, kstep
        vc, vlo, vstep = quantize(values.unflatten(-1, (d // self.cgroup, self.cgroup)), b, dim=-1)  # per token
        self.vcodes[layers, :, a:a + t] = pack(vc.flatten(-2), b)
        self.vlo[layers, :, a:a + t], self.vstep[layers, :, a:a + t] = vlo, vstep

    def dequantized(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[H_kv, tq - start, d]`` of the quantized slots ``start .. tq-1`` (``start``
        a multiple of ``group``), in the model's dtype."""
        G, b, t = self.group, self.bits, self.tq
        g0 = start // G
        kc = unpack(self.kcodes[layer, :, start:t], b).unflatten(-2, (-1, G)).float()  # [H, groups, G, d]
        keys = kc * self.kstep[layer, :, g0:t // G, None].float() + self.klo[layer, :, g0:t // G, None].float()
        vc = unpack(self.vcodes[layer, :, start:t], b).unflatten(-1, (-1, self.cgroup)).float()  # [H, T, d/Gc, Gc]
        values = vc * self.vstep[layer, :, start:t, :, None].float() + self.vlo[layer, :, start:t, :, None].float()
        return keys.flatten(1, 2).to(self.dtype), values.flatten(-2).to(self.dtype)

    @torch.inference_mode()
    def flush(self) -> None:
        """Move whole groups out of the residual window into the quantized store (all layers)."""
        t = (self.r - self.residual) // self.group * self.group
        if t <= 0:
            return
        block = self.resid[:, :, :, :t]
        self.store_quantized(slice(None), block[:, 0], block[:, 1])
        self.tq += t
        r = self.r
        self.resid[:, :, :, :r] = self.resid[:, :, :, t:r + t].clone()

    # -- attention -------------------------------------------------------------------------------
    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: Step) -> torch.Tensor:
        """Write the new entries ``k, v [n, H_kv, d]`` into the residual window and attend ``q [n, H, d]``
        over the dequantized store (from the first group a sliding layer still sees) and the window."""
        n, r, s = k.shape[0], self.r, self.layout
        put(self.resid[layer], r, k, v)
        window = s.window if sliding else None
        start = min(window_start(step.positions, window), self.tq) // self.group * self.group
        rk, rv = self.resid[layer, 0, :, : r + n], self.resid[layer, 1, :, : r + n]
        if start < self.tq:
            dk, dv = self.dequantized(layer, start)
            rk, rv = torch.cat([dk, rk], dim=1), torch.cat([dv, rv], dim=1)
        mask = grouped(visibility(self.length, step.positions, step.new_mask, window, start)[1], s.group, self.dtype)
        return attention(q, rk, rv, mask, s.scale, s.softcap)
