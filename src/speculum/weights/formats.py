"""Block-quantized matrices in the two layouts the kernels read, and the GGUF formats mapped onto them.

A :class:`QuantWeight` holds a matrix ``W [R, K]`` as integer codes with per-block scales:

- ``u4``: codes 0..15, ``w = scale * q + offset`` per block of 32;
- ``s8``: codes -128..127, ``w = scale * q`` per block of ``block`` (32 or 16).

Each GGUF format maps onto one of them exactly (the same real numbers as ``gguf``'s dequantization):

========  ======  =====  ======================================  =======================
format    layout  block  per block                               scale dtype
========  ======  =====  ======================================  =======================
Q4_0      u4      32     ``d * q - 8 d``                         float16 (as stored)
Q4_1      u4      32     ``d * q + m``                           float16 (as stored)
Q4_K      u4      32     ``(d sc) * q - (dmin m)``               float32 (the products)
Q8_0      s8      32     ``d * q``                               float16 (as stored)
Q5_0      s8      32     ``d * (q - 16)``                        float16 (as stored)
Q6_K      s8      16     ``(d sc) * (q - 32)``                   float32 (the products)
========  ======  =====  ======================================  =======================

Q4_0, Q4_1 and Q8_0 keep their bits (plus float16 offsets for Q4_0). Q4_K's 6-bit sub-block scales
become float32 (6 bits per weight instead of 4.5), and Q5_0 and Q6_K take a byte per code (8.5 and 10
bits instead of 5.5 and 6.6): simpler kernels for more bytes. Other GGUF types are not mapped
(:func:`from_gguf` returns None) and run dequantized to float.

The codes are stored for the kernels (``kernels.cpp``): rows in groups of :data:`GROUP` (the last one
padded with zero rows), and within a group and a block of 32 inputs, eight 64-byte vectors, one per
quad of 4 inputs, each holding the 16 rows' 4 codes side by side (``codes [G, K/32, 512]`` int8 for
``s8``; for ``u4`` quads ``j`` and ``j + 4`` share bytes, low and high nibble: ``[G, K/32, 256]``
uint8). Scales and offsets list a group's rows together: ``[G, K/block, 16]``. So one vector
instruction multiplies 4 inputs into 16 outputs, and a group is one contiguous stream of bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

LAYOUTS = ("u4", "s8")
GROUP = 16  # rows stored together (the kernels' vector of outputs)
QUANTIZE_FORMATS = ("Q8_0", "Q4_0", "Q4_1")  # what :func:`quantize` makes from float weights


@dataclass(frozen=True)
class QuantWeight:
    """``W [R, K]`` as codes and block scales, stored in groups of rows (module docstring); build one
    with :meth:`pack`."""

    layout: str  # "u4" | "s8"
    codes: torch.Tensor  # u4: [G, K/32, 256] uint8; s8: [G, K/32, 512] int8
    scales: torch.Tensor  # [G, K/block, GROUP] float16 | float32
    offsets: torch.Tensor | None  # u4: [G, K/32, GROUP], the scales' dtype; s8: None
    block: int  # elements per scale: 32, or 16 (s8 only)
    source: str  # the GGUF format it came from, e.g. "Q4_1"
    n_rows: int  # R (the groups hold R rounded up to GROUP)

    @classmethod
    def pack(cls, layout: str, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, block: int,
             source: str) -> QuantWeight:
        """From row-major codes ``q [R, K]`` (u4: 0..15; s8: -128..127), ``scales [R, K/block]`` and,
        for u4, ``offsets [R, K/32]``."""
        R, K = q.shape
        G = -(-R // GROUP)

        def grouped(t: torch.Tensor) -> torch.Tensor:  # [R, c] -> [G * GROUP, c], zero rows appended
            return torch.cat([t, t.new_zeros(G * GROUP - R, t.shape[1])]) if G * GROUP > R else t

        quads = grouped(q).reshape(G, GROUP, K // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [G, K/32, quad, row, 4]
        if layout == "u4":
            quads = quads.to(torch.uint8)
            codes = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).reshape(G, K // 32, 256)
        else:
            codes = quads.to(torch.int8).reshape(G, K // 32, 512)
        by_group = lambda t: None if t is None else grouped(t).reshape(G, GROUP, -1).transpose(1, 2).contiguous()
        return cls(layout, codes.contiguous(), by_group(scales), by_group(offsets), block, source, R)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.scales.shape[1] * self.block

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    def code_matrix(self) -> torch.Tensor:
        """The codes row-major: ``[R, K]`` (uint8 0..15 for u4, int8 for s8)."""
        G, nb, _ = self.codes.shape
        if self.layout == "u4":
            c = self.codes.view(G, nb, 4, GROUP, 4)
            quads = torch.cat([c & 0x0F, c >> 4], dim=2)  # [G, K/32, 8, row, 4]
        else:
            quads = self.codes.view(G, nb, 8, GROUP, 4)
        return quads.permute(0, 3, 1, 2, 4).reshape(G * GROUP, nb * 32)[:self.n_rows]

    def _row_major(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.transpose(1, 2).reshape(-1, t.shape[1])[:self.n_rows]

    def scale_matrix(self) -> torch.Tensor:
        """``[R, K/block]``."""
        return self._row_major(self.scales)

    def offset_matrix(self) -> torch.Tensor | None:
        """``[R, K/32]`` for u4, else None."""
        return self._row_major(self.offsets)

    def kernel_args(self) -> tuple:
        """``(codes, scales, offsets, block, u4, R)``: the kernels' weight arguments (offsets an empty
        tensor for s8)."""
        offsets = self.offsets if self.offsets is not None else torch.empty(0)
        return self.codes, self.scales, offsets, self.block, self.layout == "u4", self.n_rows

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index [m]`` (a permutation, a subset), as a new weight."""
        pick = lambda t: None if t is None else t.index_select(0, index)
        return QuantWeight.pack(self.layout, pick(self.code_matrix()), pick(self.scale_matrix()),
                                pick(self.offset_matrix()), self.block, self.source)

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 matrix ``[R, K]`` (or its rows ``ids``)."""
        pick = lambda t: t if ids is None or t is None else t.index_select(0, ids.to(torch.int64))
        q, s = pick(self.code_matrix()).float(), pick(self.scale_matrix()).float()
        R, K = q.shape
        if self.layout == "u4":
            q = q.reshape(R, K // 32, 32)
            return (s[..., None] * q + pick(self.offset_matrix()).float()[..., None]).reshape(R, K)
        return (q.reshape(R, K // self.block, self.block) * s[..., None]).reshape(R, K)

    def to_float32_scales(self) -> QuantWeight:
        """The same weight with float32 scales and offsets (exact: float16 widens without rounding)."""
        f = lambda t: None if t is None else t.float()
        return replace(self, scales=f(self.scales), offsets=f(self.offsets))


def cat_rows(parts: list[QuantWeight]) -> QuantWeight | None:
    """The parts stacked along the rows (a fused QKV or gate-up matrix), or None where their layouts
    or blocks differ. Scales of mixed dtypes widen to float32."""
    first = parts[0]
    if any(p.layout != first.layout or p.block != first.block or p.shape[1] != first.shape[1] for p in parts):
        return None
    if len({p.scales.dtype for p in parts}) > 1:
        parts = [p.to_float32_scales() for p in parts]
    offsets = None if first.offsets is None else torch.cat([p.offset_matrix() for p in parts])
    return QuantWeight.pack(first.layout, torch.cat([p.code_matrix() for p in parts]),
                            torch.cat([p.scale_matrix() for p in parts]), offsets, first.block,
                            "+".join(sorted({p.source for p in parts})))


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)


def from_gguf(data: np.ndarray, qtype: str, rows: int, cols: int) -> QuantWeight | None:
    """A GGUF tensor's bytes ``data [rows, row bytes]`` (as ``gguf.GGUFReader`` gives them) in a
    kernel layout, or None for a format not mapped here."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    fn = _FROM_GGUF.get(qtype)
    if fn is None:
        return None
    return fn(blocks, rows, cols)


def _nibbles(raw: np.ndarray, R: int, K: int) -> torch.Tensor:
    """GGUF's 4-bit blocks ``raw [R, K/32, 16]`` (byte ``i`` holds element ``i`` in its low nibble and
    ``i + 16`` in its high one) -> codes ``[R, K]`` uint8."""
    return torch.from_numpy(np.concatenate([raw & 0x0F, raw >> 4], axis=-1).reshape(R, K))


def _q4_0(b: np.ndarray, R: int, K: int) -> QuantWeight:
    b = b.reshape(R, K // 32, 18)
    d = _f16(b[..., :2]).reshape(R, K // 32)
    return QuantWeight.pack("u4", _nibbles(b[..., 2:], R, K), torch.from_numpy(d.copy()),
                            torch.from_numpy(d * np.float16(-8)), 32, "Q4_0")


def _q4_1(b: np.ndarray, R: int, K: int) -> QuantWeight:
    b = b.reshape(R, K // 32, 20)
    d = _f16(b[..., :2]).reshape(R, K // 32)
    m = _f16(b[..., 2:4]).reshape(R, K // 32)
    return QuantWeight.pack("u4", _nibbles(b[..., 4:], R, K), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()),
                            32, "Q4_1")


def _q8_0(b: np.ndarray, R: int, K: int) -> QuantWeight:
    b = b.reshape(R, K // 32, 34)
    d = _f16(b[..., :2]).reshape(R, K // 32)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(R, K)
    return QuantWeight.pack("s8", torch.from_numpy(codes), torch.from_numpy(d.copy()), None, 32, "Q8_0")


def _q5_0(b: np.ndarray, R: int, K: int) -> QuantWeight:
    b = b.reshape(R, K // 32, 22)
    d = _f16(b[..., :2]).reshape(R, K // 32)
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [R, K/32, 1]: bit j is element j's fifth bit
    qs = b[..., 6:]  # [R, K/32, 16]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # [R, K/32, 32]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    codes = (low | (high << 4)) - 16
    return QuantWeight.pack("s8", torch.from_numpy(codes.astype(np.int8).reshape(R, K)), torch.from_numpy(d.copy()),
                            None, 32, "Q5_0")


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of packed 6-bit scales and mins -> ``sc, m [..., 8]``."""
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(b: np.ndarray, R: int, K: int) -> QuantWeight:
    b = b.reshape(R, K // 256, 144)
    d = _f16(b[..., 0:2]).astype(np.float32)  # [R, S, 1]
    dmin = _f16(b[..., 2:4]).astype(np.float32)
    sc, mn = _k_scales(b[..., 4:16])  # [R, S, 8]
    qs = b[..., 16:].reshape(R, K // 256, 4, 32)  # pairs of sub-blocks: low nibbles 2j, high nibbles 2j+1
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(R, K // 32, 32)  # sub-block order, elements in order
    scales = (d * sc.astype(np.float32)).reshape(R, K // 32)
    offsets = -(dmin * mn.astype(np.float32)).reshape(R, K // 32)
    return QuantWeight.pack("u4", torch.from_numpy(q.astype(np.uint8).reshape(R, K)), torch.from_numpy(scales),
                            torch.from_numpy(offsets), 32, "Q4_K")


def _q6_k(b: np.ndarray, R: int, K: int) -> QuantWeight:
    b = b.reshape(R * (K // 256), 210)
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210]).astype(np.float32)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 2, 4, 32) | (high.reshape(n, 2, 4, 32) << 4)).astype(np.int16) - 32
    scales = (d * sc.astype(np.float32)).reshape(R, K // 16)
    return QuantWeight.pack("s8", torch.from_numpy(q.astype(np.int8).reshape(R, K)), torch.from_numpy(scales), None,
                            16, "Q6_K")


_FROM_GGUF = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
GGUF_FORMATS = tuple(_FROM_GGUF)


def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
    """A float matrix ``[R, K]`` (``K`` a multiple of 32) quantized to ``fmt`` (:data:`QUANTIZE_FORMATS`)
    by ``gguf``'s reference quantizers: what llama.cpp's converter would write."""
    from gguf import GGMLQuantizationType, quants

    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize to one of {', '.join(QUANTIZE_FORMATS)}, not {fmt!r}")
    R, K = weight.shape
    if K % 32:
        raise ValueError(f"a {R}x{K} matrix: block quantization needs the input width to be a multiple of 32")
    data = quants.quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[fmt])
    return from_gguf(data, fmt, R, K)
