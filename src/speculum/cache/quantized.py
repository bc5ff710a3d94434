"""A low-bit KV cache (KIVI: Liu et al., 2024): keys quantized per channel, values per token, with
the most recent entries in full precision.

Keys are quantized per channel (their outliers live in fixed channels), in groups of ``group``
tokens; values per token, in groups of ``Gc = min(group, d)`` channels; 2 or 4 bits with a float16
minimum and step per group, packed several codes to a byte, so the stored bytes really shrink
(4 bits: about 31% of bfloat16 with the default groups). The most recent entries (at least
``residual``, fewer than ``residual + group``) stay in full precision in the residual window
(:class:`~speculum.cache.window.WindowKVCache`, which also keeps tree steps reading what one-token
steps read).

Attention reads the packed store as it is stored (``quant_attend`` of :mod:`speculum.cache.kernels`:
scores and value sums computed from the codes, with the window's full-precision entries under one
softmax), so the bytes a step reads shrink with the bytes held. For that the store keeps key codes
per token group and channel, the group's codes packed together (lanes of the kernel run over
tokens), and value minima and steps per channel group along tokens. Where the kernels are not
built (or off a CPU), one layer at a time is dequantized and attended in torch
(:meth:`~speculum.cache.window.WindowKVCache.read`), with the same result to float rounding.

The encoding is a pair of pure functions per kind (:func:`encode_keys` / :func:`decode_keys`,
:func:`encode_values` / :func:`decode_values`), which GEAR and ZipCache reuse with their own
groupings.
"""

from __future__ import annotations

import torch

from ..attention import AttentionLayout
from .kernels import kernels_for, mask3
from .window import WindowKVCache

_NONE = torch.empty(0, dtype=torch.uint8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., N]`` uint8 in ``[0, 2**bits)`` -> ``[..., N * bits / 8]`` uint8, packed *planar*:
    with ``P = N * bits / 8``, byte ``j`` holds codes ``j, j + P, j + 2P, ...`` at bits ``0, bits, 2 bits, ...``
    (so that a kernel reads consecutive codes from consecutive bytes, shifted alike)."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], per, codes.shape[-1] // per)
    out = c[..., 0, :].clone()
    for j in range(1, per):
        out |= c[..., j, :] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., N * bits / 8]`` -> ``[..., N]`` uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None, :] >> shifts[:, None]) & ((1 << bits) - 1)).flatten(-2)


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


def encode_keys(keys: torch.Tensor, bits: int, group: int, exclude: torch.Tensor | None = None,
                by_group: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``[..., t, d]`` per channel over groups of ``group`` tokens (``t`` a multiple) -> packed
    codes ``[..., t, d*bits/8]`` (each token's channels packed), or with ``by_group`` ``[..., t/group,
    d, group*bits/8]`` (each group's codes of one channel packed: what ``quant_attend`` reads; ``group``
    a multiple of ``8/bits``), minimum and step ``[..., t/group, d]`` float16."""
    t = keys.shape[-2]
    split = lambda x: x.unflatten(-2, (t // group, group))
    codes, lo, step = quantize(split(keys), bits, dim=-2, exclude=None if exclude is None else split(exclude))
    if by_group:
        return pack(codes.transpose(-1, -2), bits), lo, step
    return pack(codes.flatten(-3, -2), bits), lo, step


def decode_keys(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, group: int,
                by_group: bool = False) -> torch.Tensor:
    """Inverse of :func:`encode_keys`, float32 ``[..., t, d]``."""
    if by_group:
        kc = unpack(codes, bits).transpose(-1, -2).float()  # [..., groups, G, d]
    else:
        kc = unpack(codes, bits).unflatten(-2, (-1, group)).float()
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
        kcodes: ``[layers, H_kv, T_cap / G, d, G * bits / 8]`` uint8 (:func:`encode_keys` ``by_group``).
        vcodes: ``[layers, H_kv, T_cap, d * bits / 8]`` uint8.
        klo, kstep: ``[layers, H_kv, T_cap / G, d]`` float16 (per channel, per token group).
        vlo, vstep: ``[layers, H_kv, d / Gc, T_cap]`` float16 (per group of channels, per token).
        resid: ``[layers, 2, H_kv, R_cap, d]`` the recent entries in the model's dtype.

    Class attribute ``reads_codes``: the store is the codes alone, so ``quant_attend`` reads it
    (False in a subclass that corrects what it decodes: GEAR, which reads the codes and its corrections
    together with ``gear_attend``).
    """

    reads_codes = True

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, bits: int,
                 group: int, residual: int):
        super().__init__(layout, dtype, device, capacity_hint, group, residual)
        self.cgroup = min(group, layout.head_dim)  # value channels per (minimum, step)
        if layout.head_dim % self.cgroup:
            raise ValueError(f"head dim {layout.head_dim} does not split into groups of {self.cgroup} channels")
        if group % (8 // bits):
            raise ValueError(f"a group of {group} tokens does not pack into bytes of {8 // bits} {bits}-bit codes")
        self.bits = bits
        self.kcodes = self.vcodes = None

    def allocate(self, tokens: int) -> None:
        """The quantized store, for up to ``tokens`` entries (rounded up to whole groups)."""
        s, G = self.layout, self.group
        cap = -(-tokens // G) * G
        self.kcodes = torch.empty((s.layers, s.kv_heads, cap // G, s.head_dim, G * self.bits // 8), dtype=torch.uint8,
                                  device=self.device)
        self.vcodes = torch.empty((s.layers, s.kv_heads, cap, s.head_dim * self.bits // 8), dtype=torch.uint8,
                                  device=self.device)
        self.klo = torch.empty((s.layers, s.kv_heads, cap // G, s.head_dim), dtype=torch.float16, device=self.device)
        self.kstep = torch.empty_like(self.klo)
        self.vlo = torch.empty((s.layers, s.kv_heads, s.head_dim // self.cgroup, cap), dtype=torch.float16,
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
        return (encode_keys(keys, self.bits, self.group, kx, by_group=True),
                encode_values(values, self.bits, self.cgroup, vx))

    def decode(self, kenc: tuple, venc: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode`, float32."""
        return (decode_keys(*kenc, self.bits, self.group, by_group=True),
                decode_values(*venc, self.bits, self.cgroup))

    def write_codes(self, layers: slice | int, at: int, kenc: tuple, venc: tuple) -> None:
        """Put encodings of ``t`` entries into slots ``at .. at+t-1`` of ``layers``."""
        G = self.group
        kc, klo, kstep = kenc
        vc, vlo, vstep = venc
        t = vc.shape[-2]
        self.kcodes[layers, :, at // G:(at + t) // G] = kc
        self.klo[layers, :, at // G:(at + t) // G], self.kstep[layers, :, at // G:(at + t) // G] = klo, kstep
        self.vcodes[layers, :, at:at + t] = vc
        self.vlo[layers, :, :, at:at + t] = vlo.transpose(-1, -2)  # [..., d/Gc, t]
        self.vstep[layers, :, :, at:at + t] = vstep.transpose(-1, -2)

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
        groups = slice(start // G, t // G)
        kenc = (self.kcodes[layer, :, groups], self.klo[layer, :, groups], self.kstep[layer, :, groups])
        venc = (self.vcodes[layer, :, start:t], self.vlo[layer, :, :, start:t].transpose(-1, -2),
                self.vstep[layer, :, :, start:t].transpose(-1, -2))
        return self.decode(kenc, venc)

    def dequantized(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.decoded(layer, start)
        return keys.to(self.dtype), values.to(self.dtype)

    def kernels_read_codes(self, ops) -> bool:
        """Whether the kernels ``ops`` read this store's codes: packed runs of ``group`` key codes and ``d``
        value codes that the build's vectors read, value channel groups of whole vectors (the default
        groups of 32 are)."""
        return (ops.reads_packed(self.group, self.bits) and ops.reads_packed(self.layout.head_dim, self.bits)
                and self.cgroup % ops.vector_width == 0)

    def kernel_reads(self, ops) -> bool:
        """Whether ``quant_attend`` of the kernels ``ops`` reads this store: its codes alone
        (:attr:`reads_codes`), in a layout the build reads (:meth:`kernels_read_codes`)."""
        return self.reads_codes and self.kernels_read_codes(ops)

    def code_operands(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``layer``'s codes, minima and steps in the order the kernels take them."""
        return (self.kcodes[layer], self.klo[layer], self.kstep[layer], self.vcodes[layer], self.vlo[layer],
                self.vstep[layer])

    def read(self, layer: int, q: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor,
             visible: torch.Tensor | None) -> torch.Tensor:
        """:meth:`WindowKVCache.read <speculum.cache.window.WindowKVCache.read>` on the codes as stored
        (``quant_attend``), where the kernels are built and read this layout; else in torch."""
        s = self.layout
        ops = kernels_for(q, s.head_dim)
        if ops is None or not self.kernel_reads(ops):
            return super().read(layer, q, start, keys, values, visible)
        stores = self.code_operands(layer) if start < self.tq else (_NONE,) * 6
        return ops.quant_attend(q, *stores, self.bits, start, self.tq, keys, values, mask3(visible), s.scale,
                                s.softcap or 0.0)

    def roundtrip(self, layer, keys, values, queries):
        k, v = self.decode(*self.encode(keys, values))
        return k.to(self.dtype), v.to(self.dtype)
