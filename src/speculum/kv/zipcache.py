"""``zipcache``: ZipCache (He et al., 2024, "ZipCache: Accurate and Efficient KV Cache Quantization
with Salient Token Identification"). A token's saliency is the attention it receives *normalized*
by the number of queries that can see it (accumulated attention favours early tokens, which every
query sees); salient tokens are stored at high precision (4 bits), the others at low precision (2
bits), keys channel-wise and values channel-separable token-wise
(:class:`~speculum.cache.mixed.MixedKVCache`). At prefill, saliency is measured with *probe*
queries, a sample of the prompt's (its last 5% and 5% spread over the rest), not every query.

Tokens generated later leave the full-precision window in groups; each group's saliency comes from
the group's own queries (each token scored by the later tokens of its group), so it is decided
the same way whatever steps produced the tokens (the paper re-scores new tokens every 100 steps
with the attention of that step's query).

Example: a 1000-token prompt with the defaults has probes at rows 950-999 and 50 rows spread over
0-949; of its first 960 tokens (whole groups past the 32-token window), each head keeps the 576
with the highest normalized attention at 4 bits and 384 at 2 bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import attention_probs, grouped, in_window
from ..cache.mixed import MixedKVCache
from .base import KVPolicy

PROBE_ROWS = 32  # probe queries per slice when accumulating their attention (bounds the float32 scores)


@dataclass
class ZipPrefillState:
    """One request's prefill split."""

    quantized: int  # prompt entries compressed at prefill (whole groups)
    rows: torch.Tensor  # [w] prompt rows whose queries the prefill hands over: probes, then the window's
    probes: torch.Tensor  # [w] bool: which of ``rows`` are probes


class ZipCachePolicy(KVPolicy):
    """Mixed-precision KV by normalized attention: ``hi_bits`` 4 and ``lo_bits`` 2, ``ratio`` 0.4 of
    the tokens at low precision (the reference implementation's defaults), ``probes`` 0.1 of the
    prompt's queries, ``group``/``residual`` as KIVI's window. The budget does not apply.

    Speculum quantizes channel-wise and token-wise per chunk (the prompt's quantized part, then
    each group of ``group`` tokens) where the reference code requantizes its whole cache every 100
    steps; the probe sample is spread evenly rather than drawn at random (the same request keeps
    the same output); saliency divides by the number of *probes* that see a token where the
    reference code divides by all queries that see it."""

    name = "zipcache"
    prefill_scores = "queries"
    uses_budget = False

    def __init__(self, budget=None, hi_bits: int = 4, lo_bits: int = 2, ratio: float = 0.4, probes: float = 0.1,
                 group: int = 32, residual: int = 32):
        self.budget = None
        self.bits = int(hi_bits), int(lo_bits)
        self.ratio, self.probes = float(ratio), float(probes)
        self.group, self.residual = int(group), int(residual)
        if any(b not in (2, 4, 8) for b in self.bits):
            raise ValueError(f"zipcache takes 2, 4 or 8 bits, got {hi_bits} and {lo_bits}")
        if not 0 <= self.ratio <= 1 or not 0 < self.probes <= 1:
            raise ValueError(f"zipcache takes ratio in [0, 1] and probes in (0, 1], got {ratio}, {probes}")

    def __repr__(self) -> str:
        return f"zipcache(bits={self.bits[0]}/{self.bits[1]}, ratio={self.ratio:g})"

    def new_cache(self, layout, dtype, device, capacity: int) -> MixedKVCache:
        return MixedKVCache(layout, dtype, device, capacity, self.group, self.residual, *self.bits, self.ratio)

    def probe_rows(self, n: int) -> torch.Tensor:
        """Probe rows ``[p]`` (increasing) of an ``n``-token prompt: the last ``probes / 2`` of it and as
        many spread evenly over the rest."""
        recent = max(1, math.ceil(self.probes / 2 * n))
        spread = torch.linspace(0, max(0, n - recent - 1), min(recent, n - recent)).round().long()
        return torch.cat([spread, torch.arange(n - recent, n)]).unique()

    def query_rows(self, n: int) -> torch.Tensor:
        t = max(0, (n - self.residual) // self.group * self.group)
        return torch.cat([self.probe_rows(n), torch.arange(t, n)]).unique()

    def begin_prefill(self, cache: MixedKVCache, n: int) -> None:
        t = cache.quantized_at(n)
        rows = self.query_rows(n)
        probes = torch.isin(rows, self.probe_rows(n))
        cache.state = ZipPrefillState(t, rows.to(cache.device), probes.to(cache.device))
        cache.reserve(n - t + self.group + 128)  # the residual window (tq is still 0)

    def store_prefill(self, cache: MixedKVCache, layer: int, sliding: bool, kv: torch.Tensor, queries) -> None:
        st, n = cache.state, kv.shape[2]
        t = st.quantized
        if t:
            window = cache.layout.window if sliding else None
            saliency = self.probe_saliency(cache, queries[st.probes], st.rows[st.probes], kv[0], window)
            cache.store_chunk(layer, kv[0, :, :t], kv[1, :, :t], saliency[:, :t])
        cache.resid[layer, :, :, : n - t] = kv[:, :, t:]
        cache.qres[layer, : n - t] = queries[st.rows >= t]

    @staticmethod
    def probe_saliency(cache: MixedKVCache, q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                       window: int | None) -> torch.Tensor:
        """Normalized attention ``[H_kv, n]``: the attention the probe queries ``q [p, H, d]`` (prompt rows
        ``rows [p]``) pay each of ``keys [H_kv, n, d]``, summed over probes and the query heads of each
        KV group, divided by the number of probes that see the token."""
        s, n = cache.layout, keys.shape[1]
        key_pos = torch.arange(n, device=keys.device)
        acc = torch.zeros((keys.shape[0], n), dtype=torch.float32, device=keys.device)
        seen = torch.zeros(n, dtype=torch.float32, device=keys.device)
        for a in range(0, q.shape[0], PROBE_ROWS):
            r = rows[a:a + PROBE_ROWS]
            vis = key_pos[None, :] <= r[:, None]  # [p, n]
            if window is not None:
                vis &= in_window(key_pos, r, window)
            acc += attention_probs(q[a:a + PROBE_ROWS], keys, grouped(vis, s.group, torch.float32), s.scale,
                                   s.softcap).sum(1)
            seen += vis.sum(0)
        return acc / seen.clamp(min=1)

    def end_prefill(self, cache: MixedKVCache, n: int) -> None:
        cache.tq, cache.length = cache.state.quantized, n
        cache.peak_bytes = cache.nbytes()

    def attend(self, cache, layer, sliding, q, k, v, step):
        return cache.attend(layer, sliding, q, k, v, step)

    def after_commit(self, cache: MixedKVCache) -> None:
        cache.flush()
