"""``kv_quant``: KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache"): keys are quantized per channel (their outliers live in fixed channels), in groups of
``group`` tokens; values per token, in groups of ``group`` channels; 2 or 4 bits with a
float16 minimum and step per group, packed several codes to a byte, so the stored bytes really
shrink (4 bits: about 31% of bfloat16 with the default groups). The most recent tokens (at least
``residual``, fewer than ``residual + group``) stay in full precision; whole groups leave that
window for the quantized store after each step.

Attention dequantizes one layer's keys and values at a time: memory at rest shrinks, the bytes
read per step do not (a fused low-bit attention kernel would be needed for that).
"""

from __future__ import annotations

import torch

from ..errors import SpeculumError
from .base import KVPolicy
from .cache import Step, contiguous_mask, sliding_start


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


class QuantKVCache:
    """Packed low-bit store + full-precision residual window, with the engine's commit protocol.

    Attributes (``T`` quantized tokens, a multiple of ``group``; ``G = group``):
        kcodes, vcodes: ``[layers, H_kv, T_cap, d * bits / 8]`` uint8.
        klo, kstep: ``[layers, H_kv, T_cap / G, d]`` float16 (per channel, per token group).
        vlo, vstep: ``[layers, H_kv, T_cap, d / Gc]`` float16 (per token, per group of ``Gc = min(G, d)``
            channels).
        resid: ``[layers, 2, H_kv, R_cap, d]`` the recent entries in the model's dtype; pending
            entries follow the ``r`` committed ones.
    """

    def __init__(self, decoder, capacity_hint: int, bits: int, group: int, residual: int):
        s = decoder.shape
        self.cgroup = min(group, s.head_dim)  # value channels per (minimum, step)
        if s.head_dim % self.cgroup:
            raise ValueError(f"head dim {s.head_dim} does not split into groups of {self.cgroup} channels")
        self.shape, self.dtype, self.device = s, decoder.dtype, decoder.device
        self.sliding = [layer.sliding for layer in decoder.layers]
        self.bits, self.group, self.residual = bits, group, residual
        self.capacity_hint = capacity_hint
        self.tq = self.r = self.pending = 0
        self.peak_bytes = 0
        self.kcodes = self.vcodes = None
        self.resid = torch.empty((s.layers, 2, s.kv_heads, 0, s.head_dim), dtype=self.dtype, device=self.device)
        self.state: dict = {}

    @property
    def length(self) -> int:
        return self.tq + self.r

    position = length

    def allocate(self, tokens: int) -> None:
        s, G = self.shape, self.group
        cap = -(-tokens // G) * G
        width = s.head_dim * self.bits // 8
        self.kcodes = torch.empty((s.layers, s.kv_heads, cap, width), dtype=torch.uint8, device=self.device)
        self.vcodes = torch.empty_like(self.kcodes)
        self.klo = torch.empty((s.layers, s.kv_heads, cap // G, s.head_dim), dtype=torch.float16, device=self.device)
        self.kstep = torch.empty_like(self.klo)
        self.vlo = torch.empty((s.layers, s.kv_heads, cap, s.head_dim // self.cgroup), dtype=torch.float16, device=self.device)
        self.vstep = torch.empty_like(self.vlo)

    def reserve_resid(self, slots: int) -> None:
        if slots <= self.resid.shape[3]:
            return
        shape = list(self.resid.shape)
        shape[3] = max(slots, 2 * shape[3])
        new = torch.empty(shape, dtype=self.dtype, device=self.device)
        new[:, :, :, : self.r] = self.resid[:, :, :, : self.r]
        self.resid = new

    def nbytes(self) -> int:
        """Bytes held: packed codes, their float16 minima and steps, and the residual window."""
        s, G, t = self.shape, self.group, self.tq
        per_layer_head = (2 * t * s.head_dim * self.bits // 8  # key and value codes
                          + 2 * (t // G) * s.head_dim * 2  # key minima and steps
                          + 2 * t * (s.head_dim // self.cgroup) * 2)  # value minima and steps
        resid = self.r * 2 * s.head_dim * self.resid.element_size()
        return s.layers * s.kv_heads * (per_layer_head + resid)

    # -- quantized store ---------------------------------------------------------------------------
    def store_quantized(self, layers: slice | int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``keys, values [..., H_kv, t, d]`` (``t`` a multiple of ``group``) into slots ``tq ..``."""
        G, b = self.group, self.bits
        t, d = keys.shape[-2], keys.shape[-1]
        a = self.tq
        kc, klo, kstep = quantize(keys.unflatten(-2, (t // G, G)), b, dim=-2)  # per channel over G tokens
        self.kcodes[layers, :, a:a + t] = pack(kc.flatten(-3, -2), b)
        self.klo[layers, :, a // G:(a + t) // G], self.kstep[layers, :, a // G:(a + t) // G] = klo, kstep
        vc, vlo, vstep = quantize(values.unflatten(-1, (d // self.cgroup, self.cgroup)), b, dim=-1)  # per token over G channels
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

    # -- engine protocol ---------------------------------------------------------------------------
    def begin(self, positions: torch.Tensor) -> None:
        self.reserve_resid(self.r + positions.shape[0])

    @torch.inference_mode()
    def commit(self, keep: list[int] | None = None) -> None:
        if keep is None:
            self.r += self.pending
        else:
            m = len(keep)
            if keep != list(range(m)):
                src = torch.tensor(keep, device=self.device) + self.r
                self.resid[:, :, :, self.r:self.r + m] = self.resid.index_select(3, src)
            self.r += m
        self.pending = 0
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    @torch.inference_mode()
    def flush(self) -> None:
        """Move whole groups out of the residual window into the quantized store (all layers)."""
        t = (self.r - self.residual) // self.group * self.group
        if t <= 0:
            return
        block = self.resid[:, :, :, :t]
        self.store_quantized(slice(None), block[:, 0], block[:, 1])
        self.tq += t
        self.resid[:, :, :, : self.r - t] = self.resid[:, :, :, t:self.r].clone()
        self.r -= t

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: Step) -> torch.Tensor:
        n = k.shape[0]
        self.resid[layer, 0, :, self.r:self.r + n] = k.transpose(0, 1)
        self.resid[layer, 1, :, self.r:self.r + n] = v.transpose(0, 1)
        start = min(sliding_start(step, sliding), self.tq) // self.group * self.group
        rk, rv = self.resid[layer, 0, :, : self.r + n], self.resid[layer, 1, :, : self.r + n]
        if start < self.tq:
            dk, dv = self.dequantized(layer, start)
            rk, rv = torch.cat([dk, rk], dim=1), torch.cat([dv, rv], dim=1)
        mask = contiguous_mask(step, self.length, start, sliding, self.shape.group, self.dtype)
        return step.decoder.attend(q, rk, rv, mask)


class KVQuantPolicy(KVPolicy):
    """KIVI-style asymmetric low-bit KV cache (``bits`` 2 or 4). The budget does not apply."""

    name = "kv_quant"

    def __init__(self, budget=None, bits: int = 4, group: int = 32, residual: int = 32):
        self.budget = None
        self.bits, self.group, self.residual = int(bits), int(group), int(residual)
        if self.bits not in (2, 4):
            raise SpeculumError(f"kv_quant takes 2 or 4 bits, got {bits}")

    def __repr__(self) -> str:
        return f"kv_quant(bits={self.bits})"

    def new_cache(self, runner, capacity: int) -> QuantKVCache:
        return QuantKVCache(runner.decoder, capacity, self.bits, self.group, self.residual)

    def begin_prefill(self, cache: QuantKVCache, n: int) -> None:
        cache.allocate(max(cache.capacity_hint, n + 1))
        t = max(0, (n - self.residual) // self.group * self.group)
        cache.state["prefill_quantized"] = t
        cache.reserve_resid(n - t + self.group + 128)

    def store_prefill(self, cache: QuantKVCache, layer: int, sliding: bool, kv: torch.Tensor, scores) -> None:
        t = cache.state["prefill_quantized"]
        if t:
            cache.store_quantized(layer, kv[0, :, :t], kv[1, :, :t])
        cache.resid[layer, :, :, : kv.shape[2] - t] = kv[:, :, t:]

    def end_prefill(self, cache: QuantKVCache, n: int) -> None:
        t = cache.state["prefill_quantized"]
        cache.tq, cache.r = t, n - t
        cache.peak_bytes = cache.nbytes()

    def attend(self, cache, layer, sliding, q, k, v, step):
        return cache.attend(layer, sliding, q, k, v, step)

    def after_step(self, cache: QuantKVCache) -> None:
        cache.flush()
