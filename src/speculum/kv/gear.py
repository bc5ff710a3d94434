"""``gear``: GEAR (Kang et al., 2024, "GEAR: An Efficient KV Cache Compression Recipe for
Near-Lossless Generative Inference of LLM"). Every entry is quantized to a few bits; what
quantization gets wrong is approximated by a low-rank matrix (rank ``r`` per head, from the
residual's SVD), and the few entries it would get most wrong (a fraction ``s`` of outliers) are kept
exactly in a sparse matrix. Reads attend over ``quantized + low-rank + sparse``
(:class:`~speculum.cache.gear.GearKVCache`): on CPUs through the packed codes with the KV kernels,
the low-rank term in factored form and the outliers as exact corrections, nothing dequantized;
elsewhere decoded and attended in torch.

The quantized backbone is KIVI's (keys per channel in groups of ``group`` tokens, values per
token), with its full-precision window of recent entries; the prompt's quantized part is one
chunk, and each group leaving the window afterwards is one more (the paper's streaming buffer).

Example: 4 bits, rank 4, 2% outliers on SmolLM2 (head dim 64): a prompt of 2048 entries per head
keeps 4-bit codes, 2048x4 + 4x64 factors and 2621 exact entries per head and kind.
"""

from __future__ import annotations

from ..cache.gear import GearKVCache
from .kv_quant import KVQuantPolicy


class GearPolicy(KVQuantPolicy):
    """GEAR over KIVI's store: ``bits`` 4 (2: the paper's GEAR-KIVI 2-bit setting), ``rank`` 4 and
    ``sparsity`` 0.02 (the paper's), ``group``/``residual`` as KIVI's. The budget does not apply.

    The paper finds outliers by magnitude over a whole matrix; here they are the entries farthest
    from their quantization group's mean, which are the ones that stretch a group's range (a key
    channel with a large constant offset has large magnitudes and no outliers)."""

    name = "gear"

    def __init__(self, budget=None, bits: int = 4, rank: int = 4, sparsity: float = 0.02, group: int = 32,
                 residual: int = 32):
        super().__init__(budget, bits, group, residual)
        self.rank, self.sparsity = int(rank), float(sparsity)
        if self.rank < 0 or not 0 <= self.sparsity < 1:
            raise ValueError(f"gear takes rank >= 0 and sparsity in [0, 1), got {rank}, {sparsity}")

    def __repr__(self) -> str:
        return f"gear(bits={self.bits}, rank={self.rank}, sparsity={self.sparsity:g})"

    def new_cache(self, layout, dtype, device, capacity: int) -> GearKVCache:
        return GearKVCache(layout, dtype, device, capacity, self.bits, self.group, self.residual, self.rank,
                           self.sparsity)
