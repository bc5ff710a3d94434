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

Reading (:meth:`GearKVCache.read`), where the KV kernels are built and read the codes' layout: nothing
is dequantized. With ``q`` scaled and ``Δ`` an outlier's exact value minus ``D + A B`` at its entry
(kept with it, float32), a step's logits over the store are

    q . k_t = q . D_t  +  (q B^T) . A_t  +  sum over key outliers at t of q_c Δ_tc

(the low-rank term costs ``r`` per token and ``r d`` per chunk), the softmax runs over them and the
window's logits together, and the value sums are

    sum_t p_t v_t = sum_t p_t D_t  +  sum over chunks (sum_t p_t A_t) B  +  sum over value outliers p_t Δ_tc

All of it runs in one pass of the kernels' online softmax (``gear_attend``: each piece of the codes'
scores gains its tokens' low-rank term and outliers before the softmax, its value sums after), as
KIVI's read does. This equals attention over the decoded store up to float rounding. The factors,
outliers and their corrections are stored in per-layer tensors over every chunk (the chunk's fields are
views of them), each chunk's outliers in increasing index order (a piece finds its own by bisection),
so a read is one call however many chunks there are. Elsewhere the store is decoded and attended in
torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..attention import AttentionLayout
from .kernels import kernels_for, mask3
from .quantized import _NONE, QuantKVCache
from .window import WindowKVCache


@dataclass
class GearChunk:
    """The error-correction terms of one compressed chunk, every layer."""

    start: int  # first slot
    a: torch.Tensor  # [layers, 2, H_kv, t, r] float16 residual's left factors (one row per entry)
    b: torch.Tensor  # [layers, 2, H_kv, r, d] float16 right factors
    idx: torch.Tensor  # [layers, 2, H_kv, k] int32 outliers' flat index (token * d + channel) in the chunk
    val: torch.Tensor  # [layers, 2, H_kv, k] their exact values (model dtype)
    delta: torch.Tensor  # [layers, 2, H_kv, k] float32: val minus the codes' and factors' value at the entry

    @property
    def end(self) -> int:
        return self.start + self.a.shape[3]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.idx, self.val, self.delta))


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
    idx = dev.flatten(-2).topk(k, dim=-1).indices.sort(dim=-1).values  # increasing: the kernels bisect them
    mask = torch.zeros(x.shape[:-2] + (t * d,), dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
    return idx, mask.view(x.shape)


class GearKVCache(QuantKVCache):
    """:class:`QuantKVCache` whose chunks carry GEAR's low-rank and sparse corrections (``rank``,
    ``sparsity``: fraction of entries kept exactly)."""

    reads_codes = False  # not by quant_attend alone: :meth:`read` adds the corrections to the codes' read

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, bits: int,
                 group: int, residual: int, rank: int, sparsity: float):
        super().__init__(layout, dtype, device, capacity_hint, bits, group, residual)
        self.rank, self.sparsity = rank, sparsity
        self.chunks: list[GearChunk] = []
        self.kstart: list[int] = [0]  # chunk i's outliers are entries kstart[i] .. kstart[i+1]-1 of oidx

    def allocate(self, tokens: int) -> None:
        """The codes (:meth:`QuantKVCache.allocate`) and every chunk's corrections, in per-layer tensors
        that the chunks' fields view (up to one chunk per group):

        - ``fa [layers, 2, H_kv, r, T_cap]`` float16 left factors by slot, transposed (zero past a chunk's
          rank);
        - ``fb [layers, 2, H_kv, T_cap / G, r, d]`` float16 right factors by chunk; ``chunk_of [T_cap / G]``
          each group's chunk;
        - ``oidx``, ``oval``, ``odelta [layers, 2, H_kv, K_cap]`` the outliers in chunk order (flat index in
          their chunk, exact value, correction) and ``obase [K_cap]`` int64 their chunk's first flat index
          (``start * d``)."""
        super().allocate(tokens)
        s, G = self.layout, self.group
        cap = self.vcodes.shape[2]
        lead, dev = (s.layers, 2, s.kv_heads), self.device
        r = min(self.rank, s.head_dim)
        self.fa = torch.zeros(lead + (r, cap), dtype=torch.float16, device=dev)
        self.fb = torch.zeros(lead + (cap // G, r, s.head_dim), dtype=torch.float16, device=dev)
        self.chunk_of = torch.zeros(cap // G, dtype=torch.long, device=dev)
        kcap = int(self.sparsity * cap * s.head_dim) + cap // G + 1  # sum over chunks of round(sparsity t d)
        self.oidx = torch.zeros(lead + (kcap,), dtype=torch.int32, device=dev)
        self.oval = torch.zeros(lead + (kcap,), dtype=self.dtype, device=dev)
        self.odelta = torch.zeros(lead + (kcap,), dtype=torch.float32, device=dev)
        self.obase = torch.zeros(kcap, dtype=torch.int32, device=dev)

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
        decoded = torch.stack(self.decode(kenc, venc), dim=-4)
        resid = (x - decoded).masked_fill_(out, 0)
        u, sv, vh = torch.linalg.svd(resid, full_matrices=False)
        r = min(self.rank, t, d)
        a, b = (u[..., :r] * sv[..., None, :r]).half(), vh[..., :r, :].half()
        val = x.flatten(-2).gather(-1, idx).to(self.dtype)
        # what a read adds at an outlier's entry: its exact value minus the codes' and factors' value there
        delta = val.float() - (decoded + a.float() @ b.float()).flatten(-2).gather(-1, idx)
        return kenc, venc, (a, b, idx.to(torch.int32), val, delta)

    @staticmethod
    def correct(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, val: torch.Tensor,
                delta: torch.Tensor | None = None) -> torch.Tensor:
        """Add the low-rank term ``a [..., t, r] @ b [..., r, d]`` to ``x [..., t, d]`` (float32) and write
        the outliers ``val`` at flat indices ``idx [..., k]`` over it (``delta``: unused, as
        :meth:`compress` gives it)."""
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
            a, idx = extra[0], extra[2]
            t, r, k, i, k0 = a.shape[-2], a.shape[-1], idx.shape[-1], len(self.chunks), self.kstart[-1]
            if k0 + k > self.oidx.shape[-1] or i >= self.fb.shape[3]:
                raise ValueError(f"the GEAR store holds {self.oidx.shape[-1]} outliers and {self.fb.shape[3]} chunks")
            outl = slice(k0, k0 + k)
            chunk = GearChunk(at, self.fa[:, :, :, :r, at:at + t].transpose(-1, -2), self.fb[:, :, :, i, :r],
                              self.oidx[..., outl],
                              self.oval[..., outl], self.odelta[..., outl])
            self.chunk_of[at // self.group:(at + t) // self.group] = i
            self.obase[outl] = at * self.layout.head_dim
            self.chunks.append(chunk)
            self.kstart.append(k0 + k)
        chunk.a[layers], chunk.b[layers], chunk.idx[layers], chunk.val[layers], chunk.delta[layers] = extra

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

    def kernel_reads(self, ops) -> bool:
        """Whether the kernels ``ops`` read this store's codes (:meth:`read` adds the corrections)."""
        return self.kernels_read_codes(ops)

    def read(self, layer: int, q: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor,
             visible: torch.Tensor | None) -> torch.Tensor:
        """:meth:`WindowKVCache.read <speculum.cache.window.WindowKVCache.read>` on the codes as stored, the
        low-rank terms in factored form and the outliers' corrections in the same pass (``gear_attend``; the
        module's docstring), where the kernels are built and read the codes' layout; else decoded and
        attended in torch."""
        s = self.layout
        ops = kernels_for(q, s.head_dim)
        if ops is None or not self.kernel_reads(ops):
            return WindowKVCache.read(self, layer, q, start, keys, values, visible)
        softcap = s.softcap or 0.0
        if start >= self.tq:
            return ops.quant_attend(q, *(_NONE,) * 6, self.bits, start, self.tq, keys, values,
                                    mask3(visible), s.scale, softcap)
        c0, c1 = self._chunk_range(start)
        return ops.gear_attend(q, *self.code_operands(layer), self.bits, start, self.tq, keys, values,
                               mask3(visible), s.scale, softcap, self.fa[layer], self.fb[layer], self.chunk_of,
                               c0, c1, self.oidx[layer], self.obase, self.odelta[layer], self.kstart[c1])

    def _chunk_range(self, start: int) -> tuple[int, int]:
        """The chunks holding slots ``start .. tq-1``: ``c0 .. c1-1``."""
        starts = [c.start for c in self.chunks]
        c0 = bisect.bisect_right(starts, start) - 1
        c1 = bisect.bisect_left(starts, self.tq)
        return c0, c1

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
