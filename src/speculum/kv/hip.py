"""``hip``: HiP, Hierarchically Pruned Attention (Lee et al., 2024, "A Training-free Sub-quadratic
Cost Transformer Model Serving Framework With Hierarchically Pruned Attention"). Attention is
local: neighbouring keys get similar scores, so a range of keys can be judged by one key. For a
query, the key range (in blocks of ``block`` tokens) starts split into ``k`` branches (``k =
budget / block``); at each level every kept range is split in two, each half is scored by the
query's product with one *representative* key, the half's centre, and the ``k`` best halves are
kept; after about ``log2(range / k)`` levels every kept range is one block, and those ``k``
blocks are read. No cached statistics are needed: the search reads ``2k`` keys per level.

Where the row kernels are built (``hip_search``, :mod:`speculum.cache.row_kernels`) the search runs per
KV head and row in one pass, halves tied in score going to the earlier one; the torch code below is
the reference it follows (its ``topk`` breaks ties its own way).

Each query row runs the search over its own context (:mod:`speculum.kv.rows`), so tree
verification reads what one-token steps read. Selection is per KV head (a half scores as the best
of the head's query rows); the first ``sinks`` and last ``window`` tokens are outside the search
and always read.

Example: 16 tokens, ``block = 1``, ``k = 2``, the query matching token 13: branches [0, 8) and
[8, 16); halves [0, 4) [4, 8) [8, 12) [12, 16) scored by keys 1, 5, 9, 13 (centres): keep [8, 12)
and [12, 16); then [8, 10) [10, 12) [12, 14) [14, 16) by 8, 10, 12, 14: keep [12, 14) and one
other; then single tokens: 13 is read.
"""

from __future__ import annotations

import torch

from ..attention import fold_queries
from ..cache.row_kernels import row_kernels_for
from .rows import RowSparsePolicy, RowView


class HiPPolicy(RowSparsePolicy):
    """Hierarchical top-k over key blocks, judged by representative keys.

    Options: ``block`` (2: the paper's key block size), ``sinks``, ``window`` (0): tokens outside
    the search, always read; ``dense``: leading layers that attend densely (2, as the other
    sparse-read policies: speculum's convention).
    """

    name = "hip"

    def __init__(self, budget="0.25", block: int = 2, sinks: int = 0, window: int = 0, dense: int = 2):
        super().__init__(budget)
        self.block, self.sinks, self.window, self.dense_layers = int(block), int(sinks), int(window), int(dense)
        if self.block < 1:
            raise ValueError(f"block must be at least 1, got {self.block}")
        if min(self.sinks, self.window, self.dense_layers) < 0:
            raise ValueError("sinks, window and dense must be non-negative")

    def branches(self, read: int) -> int:
        """``k``: blocks read per row."""
        return max(1, read // self.block)

    def covers(self, st, rows):
        return int(rows.positions.max()) - self.sinks - self.window <= self.branches(st.read) * self.block

    def select(self, cache, layer, q, k, rows: RowView):
        s = cache.layout
        kb, b = self.branches(cache.state.read), self.block
        span = (rows.positions - self.sinks - self.window).clamp(min=0)  # [n] tokens in each row's search
        ops = row_kernels_for(q)
        if ops is not None:  # the whole search per KV head and row in one pass, keys read in place
            anc = rows.ancestor_columns() if int(rows.positions.max()) > rows.length else span.new_zeros(rows.n, 0)
            chosen = ops.hip_search(q.float().contiguous(), cache.kv[layer, 0], span.contiguous(), anc.contiguous(),
                                    rows.length, kb, b, self.sinks)
            return (chosen & rows.context) | rows.always(self.sinks, self.window)
        blocks = (span + b - 1) // b  # [n]
        j = torch.arange(kb, device=q.device)
        start = (j[None, :] * blocks[:, None]) // kb  # [n, kb] in blocks
        end = ((j[None, :] + 1) * blocks[:, None]) // kb
        start, end = (t.expand(s.kv_heads, -1, -1) for t in (start, end))  # [H_kv, n, kb]
        qg = fold_queries(q, s.kv_heads).view(s.kv_heads, s.group, rows.n, -1)  # [H_kv, g, n, d]
        while int((end - start).max()) > 1:
            mid = start + (end - start + 1) // 2
            halves_start, halves_end = torch.cat([start, mid], -1), torch.cat([mid, end], -1)  # [H_kv, n, 2kb]
            score = self.representative_scores(cache, layer, qg, rows, span, halves_start, halves_end)
            top = score.topk(kb, dim=-1).indices
            start, end = halves_start.gather(-1, top), halves_end.gather(-1, top)
        return self.read_blocks(rows, span, start, end) | rows.always(self.sinks, self.window)

    def representative_scores(self, cache, layer: int, qg: torch.Tensor, rows: RowView, span: torch.Tensor,
                              start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Each range ``start .. end`` (blocks, ``[H_kv, n, m]``) scored by its centre key: the best of the
        KV head's query rows ``qg [H_kv, g, n, d]`` -> ``[H_kv, n, m]`` float32 (-inf for empty ranges)."""
        b = self.block
        first, last = start * b, torch.minimum(end * b, span[None, :, None])  # tokens [first, last)
        centre = self.sinks + (first + last - 1).clamp(min=0) // 2
        cols = rows.columns_of(centre.clamp(max=int(rows.positions.max()) - 1))  # [H_kv, n, m]
        heads, n, m = cols.shape
        keys = cache.kv[layer, 0].gather(1, cols.reshape(heads, n * m, 1).expand(-1, -1, qg.shape[-1]))
        score = torch.einsum("hgnd,hnmd->hgnm", qg, keys.view(heads, n, m, -1)).float().amax(1)
        return score.masked_fill(last <= first, float("-inf"))

    def read_blocks(self, rows: RowView, span: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """The tokens of the kept blocks ``start .. end`` (``[H_kv, n, kb]``, each one block or empty) ->
        ``[H_kv, n, L+n]`` bool."""
        heads, n, _ = start.shape
        C = rows.columns
        visible = torch.zeros((heads, n, C + 1), dtype=torch.bool, device=start.device)  # column C: a sink for padding
        for o in range(self.block):
            token = start * self.block + o  # [H_kv, n, kb] within the search
            valid = (end > start) & (token < span[None, :, None])
            cols = rows.columns_of(torch.where(valid, self.sinks + token, 0))
            visible.scatter_(2, torch.where(valid, cols, C), True)
        return visible[:, :, :C] & rows.context
