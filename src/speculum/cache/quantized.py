"""A low-bit KV cache (KIVI: Liu et al., 2024): keys quantized per channel, values per token, with
the most recent entries in full precision.

Keys are quantized per channel (their outliers live in fixed channels), in groups of ``group``
tokens; values per token, in groups of ``Gc = min(group, d)`` channels; 2 or 4 bits with a float16
minimum and step per group, packed several codes to a byte, so the stored bytes really shrink
(4 bits: about 31% of bfloat16 with the default groups). The most recent entries (at least
``residual``, fewer than ``residual + group``) stay in full precision in the residual window
(:class:`~speculum.cache.window.WindowKVCache`, which also keeps tree steps reading what one-token
steps read).

Attention dequantizes one layer's keys and values at a time: memory at rest shrinks, the bytes
read per step do not (a fused low-bit attention kernel would be needed for that; it would replace
:meth:`~speculum.cache.window.WindowKVCache.read`).

The encoding is a pair of pure functions per kind (:func:`encode_keys` / :func:`decode_keys`,
:func:`encode_values` / :func:`decode_values`), which GEAR and ZipCache reuse with their own
groupings.
"""

from __future__ import annotations

import torch

from ..attention import AttentionLayout
from .window import WindowKVCache


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


def quantize(x: torch.Tensor, bits: int, dim: int,
             exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization of ``x`` with one (minimum, step) per slice along ``dim``.

    ``exclude`` (bool, shaped like ``x``): entries left out of each slice's range (GEAR's outliers,
    kept exactly elsewhere); their codes clamp to the range. A slice with every entry excluded
    keeps its whole range. Returns ``codes`` (uint8, shaped like ``x``), ``lo`` and ``step``
    (float16, ``dim`` reduced)."""
    xf = x.float()
    if exclude is None:
        lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    else:
        lo = xf.masked_fill(exclude, float("inf")).amin(dim, keepdim=True)
        hi = xf.masked_fill(exclude, float("-inf")).amax(dim, keepdim=True)
        empty = lo > hi
        if bool(empty.any()):
            lo = torch.where(empty, xf.amin(dim, keepdim=True), lo)
            hi = torch.where(empty, xf.amax(dim, keepdim=True), hi)
    step = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    codes = ((xf - lo) / step).round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes, lo.squeeze(dim).half(), step.squeeze(dim).half()


def encode_keys(keys: torch.Tensor, bits: int, group: int,
                exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``[..., t, d]`` per channel over groups of ``group`` tokens (``t`` a multiple) -> packed
    codes ``[..., t, d*bits/8]``, minimum and step ``[..., t/group, d]`` float16."""
    t = keys.shape[-2]
    split = lambda x: x.unflatten(-2, (t // group, group))
    codes, lo, step = quantize(split(keys), bits, dim=-2, exclude=None if exclude is None else split(exclude))
    return pack(codes.flatten(-3, -2), bits), lo, step


def decode_keys(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`encode_keys`, float32 ``[..., t, d]``."""
    kc = unpack(codes, bits).unflatten(-2, (-1, group)).float()  # [..., groups, G, d]
    return (kc * step[..., None, :].float() + lo[..., None, :].float()).flatten(-3, -2)


def encode_values(values: torch.Tensor, bits: int, cgroup: int,
                  exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[..., t, d]`` per token over groups of ``cgroup`` channels -> packed codes
    ``[..., t, d*bits/8]``, minimum and step ``[..., t, d/cgroup]`` float16."""
    d = values.shape[-1]
    split = lambda x: x.unflatten(-1, (d // cgroup, cgroup))
    codes, lo, step = quantize(split(values), bits, dim=-1, exclude=None if exclude is None else split(exclude))
    return pack(codes.flatten(-2), bits), lo, step


def decode_values(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, cgroup: int) -> torch.Tensor:
    """Inverse of :func:`encode_values`, float32 ``[..., t, d]``."""
    vc = unpack(codes, bits).unflatten(-1, (-1, cgroup)).float()  # [..., t, d/Gc, Gc]
    return (vc * step[..., None].float() + lo[..., None].float()).flatten(-2)


class QuantKVCache(WindowKVCache):
    """Packed low-bit store for slots ``0 .. tq-1`` + full-precision residual window for the rest.

    Attributes (``T`` quantized tokens, a multiple of ``group``; ``G = group``):
        kcodes, vcodes: ``[layers, H_kv, T_cap, d * bits / 8]`` uint8.
        klo, kstep: ``[layers, H_kv, T_cap / G, d]`` float16 (per channel, per token group).
        vlo, vstep: ``[layers, H_kv, T_cap, d / Gc]`` float16 (per token, per group of channels).
        resid: ``[layers, 2, H_kv, R_cap, d]`` the recent entries in the model's dtype.
    """

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, bits: int,
                 group: int, residual: int):
        super().__init__(layout, dtype, device, capacity_hint, group, residual)
        self.cgroup = min(group, layout.head_dim)  # value channels per (minimum, step)
        if layout.head_dim % self.cgroup:
            raise ValueError(f"head dim {layout.head_dim} does not split into groups of {self.cgroup} channels")
        self.bits = bits
        self.kcodes = self.vcodes = None

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

    def store_nbytes(self) -> int:
        """Packed codes and their float16 minima and steps."""
        s, G, t = self.layout, self.group, self.tq
        per_layer_head = (2 * t * s.head_dim * self.bits // 8  # key and value codes
                          + 2 * (t // G) * s.head_dim * 2  # key minima and steps
                          + 2 * t * (s.head_dim // self.cgroup) * 2)  # value minima and steps
        return s.layers * s.kv_heads * per_layer_head

    # -- quantized store ---------------------------------------------------------------------------
    def encode(self, keys: torch.Tensor, values: torch.Tensor, kx: torch.Tensor | None = None,
               vx: torch.Tensor | None = None) -> tuple[tuple, tuple]:
        """``keys, values [..., t, d]`` -> their encodings (:func:`encode_keys`, :func:`encode_values`);
        ``kx, vx``: entries left out of the ranges (GEAR)."""
        return (encode_keys(keys, self.bits, self.group, kx), encode_values(values, self.bits, self.cgroup, vx))

    def decode(self, kenc: tuple, venc: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode`, float32."""
        return decode_keys(*kenc, self.bits, self.group), decode_values(*venc, self.bits, self.cgroup)

    def write_codes(self, layers: slice | int, at: int, kenc: tuple, venc: tuple) -> None:
        """Put encodings of ``t`` entries into slots ``at .. at+t-1`` of ``layers``."""
        G = self.group
        kc, klo, kstep = kenc
        t = kc.shape[-2]
        self.kcodes[layers, :, at:at + t] = kc
        self.klo[layers, :, at // G:(at + t) // G], self.kstep[layers, :, at // G:(at + t) // G] = klo, kstep
        vc, vlo, vstep = venc
        self.vcodes[layers, :, at:at + t] = vc
        self.vlo[layers, :, at:at + t], self.vstep[layers, :, at:at + t] = vlo, vstep

    def store_quantized(self, layers: slice | int, keys: torch.Tensor, values: torch.Tensor,
                        at: int | None = None) -> None:
        """Quantize ``keys, values [..., H_kv, t, d]`` (``t`` a multiple of ``group``) into slots ``at ..``
        (default ``tq``)."""
        self.write_codes(layers, self.tq if at is None else at, *self.encode(keys, values))

    def store_block(self, keys, values, queries) -> None:
        self.store_quantized(slice(None), keys, values)

    def decoded(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`dequantized` in float32."""
        G, t = self.group, self.tq
        kenc = (self.kcodes[layer, :, start:t], self.klo[layer, :, start // G:t // G], self.kstep[layer, :, start // G:t // G])
        venc = (self.vcodes[layer, :, start:t], self.vlo[layer, :, start:t], self.vstep[layer, :, start:t])
        return self.decode(kenc, venc)

    def dequantized(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.decoded(layer, start)
        return keys.to(self.dtype), values.to(self.dtype)

    def roundtrip(self, layer, keys, values, queries):
        k, v = self.decode(*self.encode(keys, values))
        return k.to(self.dtype), v.to(self.dtype)
