"""GEAR's store (Kang et al., 2024): KIVI's low-bit codes, plus for every compressed chunk a low-rank
approximation of what quantization got wrong and the outliers kept exactly.

A chunk is the prompt's quantized part (at prefill) or one group of ``group`` tokens (each flush
compresses its groups one by one, so the store never depends on how tokens were grouped into
steps). Per layer, KV head and kind, a chunk ``X [t, d]`` (keys or values) is stored as:

1. outliers ``S``: the ``sparsity`` fraction of entries farthest from the mean of their
   quantization group (keys: a channel over ``group`` tokens; values: a token over ``Gc``
   channels), their exact values and flat indices;
2. KIVI codes ``D`` of ``X`` with the outliers left out of each group's range (:func:`quantize`'s
   ``exclude``);
3. the rank-``r`` truncated SVD of the residual ``R = X - D`` (zero at the outliers):
   ``A = U_r Sigma_r [t, r]``, ``B = V_r^T [r, d]``.

It reads back as ``D + A B`` with the outliers written over. Example with ``t = 32``, ``d = 64``,
``r = 4`` and 2% sparsity: 41 exact entries, 32x4 + 4x64 float16 factors, and the 4-bit codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionLayout
from .quantized import QuantKVCache


@dataclass
class GearChunk:
    """The error-correction terms of one compressed chunk, every layer."""

    start: int  # first slot
    a: torch.Tensor  # [layers, 2, H_kv, t, r] float16 residual's left factors (one row per entry)
    b: torch.Tensor  # [layers, 2, H_kv, r, d] float16 right factors
    idx: torch.Tensor  # [layers, 2, H_kv, k] int32 outliers' flat index (token * d + channel) in the chunk
    val: torch.Tensor  # [layers, 2, H_kv, k] their exact values (model dtype)

    @property
    def end(self) -> int:
        return self.start + self.a.shape[3]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.idx, self.val))


def outlier_mask(x: torch.Tensor, k: int, group: int, along_tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of each matrix ``x [..., t, d]`` farthest from their quantization group's mean
    (groups of ``group`` tokens per channel, or of ``group`` channels per token): their flat indices
    ``[..., k]`` int64 and a bool mask shaped like ``x``."""
    t, d = x.shape[-2:]
    if along_tokens:
        g = x.unflatten(-2, (t // group, group))
        dev = (g - g.mean(-2, keepdim=True)).abs().flatten(-3, -2)
    else:
        g = x.unflatten(-1, (d // group, group))
        dev = (g - g.mean(-1, keepdim=True)).abs().flatten(-2)
    idx = dev.flatten(-2).topk(k, dim=-1).indices
    mask = torch.zeros(x.shape[:-2] + (t * d,), dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
    return idx, mask.view(x.shape)


class GearKVCache(QuantKVCache):
    """:class:`QuantKVCache` whose chunks carry GEAR's low-rank and sparse corrections (``rank``,
    ``sparsity``: fraction of entries kept exactly)."""

    reads_codes = False  # its corrections come after decoding: read in torch, not by quant_attend

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, bits: int,
                 group: int, residual: int, rank: int, sparsity: float):
        super().__init__(layout, dtype, device, capacity_hint, bits, group, residual)
        self.rank, self.sparsity = rank, sparsity
        self.chunks: list[GearChunk] = []

    def compress(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[tuple, tuple, tuple]:
        """``keys, values [..., H_kv, t, d]`` -> KIVI encodings and ``(a, b, idx, val)``, each with a kind
        axis ``[..., 2, H_kv, ...]`` (keys, values)."""
        x = torch.stack([keys, values], dim=-4).float()  # [..., 2, H, t, d]
        t, d = x.shape[-2:]
        k = round(self.sparsity * t * d)
        if k:
            (ki, kx), (vi, vx) = (outlier_mask(x[..., 0, :, :, :], k, self.group, True),
                                  outlier_mask(x[..., 1, :, :, :], k, self.cgroup, False))
            idx, out = torch.stack([ki, vi], dim=-3), torch.stack([kx, vx], dim=-4)
        else:
            kx = vx = None
            idx = torch.zeros(x.shape[:-2] + (0,), dtype=torch.long, device=x.device)
            out = torch.zeros_like(x, dtype=torch.bool)
        kenc, venc = self.encode(keys, values, kx, vx)
        resid = (x - torch.stack(self.decode(kenc, venc), dim=-4)).masked_fill_(out, 0)
        u, sv, vh = torch.linalg.svd(resid, full_matrices=False)
        r = min(self.rank, t, d)
        a, b = (u[..., :r] * sv[..., None, :r]).half(), vh[..., :r, :].half()
        val = x.flatten(-2).gather(-1, idx).to(self.dtype)
        return kenc, venc, (a, b, idx.to(torch.int32), val)

    @staticmethod
    def correct(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        """Add the low-rank term ``a [..., t, r] @ b [..., r, d]`` to ``x [..., t, d]`` (float32) and write
        the outliers ``val`` at flat indices ``idx [..., k]`` over it."""
        x = x + a.float() @ b.float()
        return x.flatten(-2).scatter_(-1, idx.long(), val.float()).view(x.shape)

    # -- the store ------------------------------------------------------------------------------------
    def store_quantized(self, layers, keys, values, at=None) -> None:
        """Compress ``keys, values [..., H_kv, t, d]`` as one chunk at slots ``at ..`` (default ``tq``):
        the prefill stores the prompt's chunk layer by layer, a flush one group for every layer."""
        at = self.tq if at is None else at
        kenc, venc, extra = self.compress(keys, values)
        self.write_codes(layers, at, kenc, venc)
        chunk = self.chunks[-1] if self.chunks and self.chunks[-1].start == at else None
        if chunk is None:
            s = self.layout
            lead = (s.layers, 2, s.kv_heads)
            a, b, idx, val = extra
            chunk = GearChunk(at, a.new_zeros(lead + a.shape[-2:]), b.new_zeros(lead + b.shape[-2:]),
                              idx.new_zeros(lead + idx.shape[-1:]), val.new_zeros(lead + val.shape[-1:]))
            self.chunks.append(chunk)
        chunk.a[layers], chunk.b[layers], chunk.idx[layers], chunk.val[layers] = extra

    def store_block(self, keys, values, queries) -> None:
        for i in range(0, keys.shape[-2], self.group):  # one chunk per group
            self.store_quantized(slice(None), keys[..., i:i + self.group, :], values[..., i:i + self.group, :],
                                 at=self.tq + i)

    def decoded(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.stack(super().decoded(layer, start))  # [2, H, T, d] slots start .. tq-1
        for c in self.chunks:
            if c.end <= start or c.start >= self.tq:
                continue
            a0 = max(start, c.start)
            x[:, :, a0 - start:c.end - start] += c.a[layer, :, :, a0 - c.start:].float() @ c.b[layer].float()
            self._write_outliers(x, c, layer, start)
        return x[0], x[1]

    @staticmethod
    def _write_outliers(x: torch.Tensor, c: GearChunk, layer: int, start: int) -> None:
        """Write chunk ``c``'s outliers of ``layer`` that fall at or after slot ``start`` into ``x [2, H, T, d]``
        (slots ``start ..``)."""
        two, heads, span, d = x.shape
        idx = c.idx[layer].long()  # [2, H, k]
        row = idx // d + (c.start - start)
        base = torch.arange(two * heads, device=x.device).view(two, heads, 1) * (span * d)
        flat = base + row * d + idx % d
        keep = row >= 0
        x.view(-1)[flat[keep]] = c.val[layer][keep].float()

    def roundtrip(self, layer, keys, values, queries):
        kenc, venc, extra = self.compress(keys, values)
        x = self.correct(torch.stack(self.decode(kenc, venc)), *extra)
        return x[0].to(self.dtype), x[1].to(self.dtype)

    def store_nbytes(self) -> int:
        """The KIVI codes and every chunk's factors and outliers."""
        return super().store_nbytes() + sum(c.nbytes() for c in self.chunks)
