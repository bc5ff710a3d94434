"""``tidal``: TidalDecode (Yang et al., 2024, "TidalDecode: Fast and Accurate LLM Decoding with
Position Persistent Sparse Attention"). The first layers attend fully; a token-selection layer
also attends fully and picks the ``k`` cached tokens with the highest attention (per KV head,
summed over its query heads); every later layer attends only to those positions, until a
re-selection layer picks again (defaults: :func:`default_selection_layers`). The cache is kept
whole: what shrinks is the bytes read per step (``k`` of the context's entries in the sparse
layers, read in place through :meth:`~speculum.cache.PositionedKVCache.attend_rows`, so nothing is
copied and memory stays at the full cache's).

Each query row of a step selects for itself, over what a one-token step at its position would find
cached (:mod:`speculum.kv.rows`): the committed tokens and its tree ancestors. A token's output
then does not depend on how tokens were grouped into steps, and speculation under ``tidal`` gives
plain decoding's output under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import RowView, read_rows, row_reads, top_stable
from .scoring import pool_scores
from .sparse import SparseReadPolicy, SparseState


@dataclass
class TidalState(SparseState):
    """One request's token selection."""

    selection_layers: frozenset[int] = frozenset()
    reads: tuple | None = None  # this step's rows' choice as read_rows reads it (rows.row_reads)
    sparse: frozenset[int] = frozenset()  # the layers that read them (up to the next selection layer)
    selected_at: int = -1  # cache length when ``reads`` were chosen (this step's, or stale)


def default_selection_layers(sliding: list[bool], dense_layers: int = 2) -> list[int]:
    """Selection at about 1/5 of the depth and re-selection at about 7/15, among full-attention
    layers (SmolLM2's 30 layers: 6 and 14; Llama-3-8B's 32: 6 and 15). The paper chose layers per
    model (2 and 13 for Llama-3-8B); this rule is speculum's, for models the paper did not cover
    (BENCHMARKS.md, "Why the defaults", has what it was chosen on). Models with sliding-window
    layers (Gemma-3: one global layer in six) select once, at the first global layer from 1/5 of
    the depth on."""
    layers = len(sliding)
    full = [i for i, s in enumerate(sliding) if not s and i >= max(dense_layers, round(layers / 5))]
    if not full:
        return []
    first = full[0]
    if any(sliding):
        return [first]
    again = min(full, key=lambda i: abs(i - round(layers * 7 / 15)))
    return [first] if again <= first else [first, again]


class TidalPolicy(SparseReadPolicy):
    """Position-persistent sparse attention; ``layers``: the selection layers (``"6+14"`` on the CLI);
    ``kernel``: max-pool the selection scores over that many neighbours before the top-k (1: the
    paper's plain top-k; speculum's default 7 keeps runs of digit tokens together: BENCHMARKS.md,
    "Why the defaults")."""

    name = "tidal"

    def __init__(self, budget="0.25", layers=None, dense: int = 2, kernel: int = 7):
        super().__init__(budget)
        self.kernel = int(kernel)
        self.dense_layers = int(dense)
        if isinstance(layers, str):
            layers = [int(x) for x in layers.replace("+", " ").split()]
        self.layers = layers

    def new_state(self, cache, read):
        layers = self.layers if self.layers is not None else default_selection_layers(
            [cache.layout.is_sliding(i) for i in range(cache.layout.layers)], self.dense_layers)
        return TidalState(read, frozenset(layers))

    def select(self, cache, layer: int, q: torch.Tensor, rows: RowView) -> torch.Tensor:
        """Each row's ``read`` best positions by the attention it pays them (summed over the KV group's
        query heads, max-pooled along positions), every position where the row's context is no longer:
        bool ``[H_kv, n, L+n]`` over the step's columns."""
        s, n = cache.layout, rows.n
        probs = cache.slot_probs(layer, q, rows.columns, rows.context)  # [H_kv, g*n, L+n], keys read in place
        scores, inside = rows.by_position(probs.view(s.kv_heads, s.group, n, -1).sum(1))  # [H_kv, n, P]
        pooled = pool_scores(scores.flatten(0, 1), self.kernel).view_as(scores)
        return rows.to_columns(top_stable(pooled, inside, cache.state.read))

    def attend(self, cache, layer, sliding, q, k, v, step):
        st = cache.state
        if sliding or layer < self.dense_layers:
            return cache.attend_all(layer, sliding, q, k, v, step)
        rows = RowView.of(cache.length, step)
        if int(rows.positions.max()) <= st.read:  # every row's context fits the budget: all read
            return cache.attend_all(layer, sliding, q, k, v, step)
        if layer in st.selection_layers:
            out = cache.attend_all(layer, sliding, q, k, v, step)  # writes the new entries: every column a slot
            later = [i for i in st.selection_layers if i > layer]
            upto = min(later) if later else cache.layout.layers
            # the full-attention layers up to the next selection layer read the chosen positions
            st.sparse = frozenset(i for i in range(layer + 1, upto) if not cache.layout.is_sliding(i))
            st.reads = row_reads(self.select(cache, layer, q, rows), rows, cache.layout.kv_heads)
            st.selected_at = cache.length
            return out
        if st.selected_at != cache.length or layer not in st.sparse:
            return cache.attend_all(layer, sliding, q, k, v, step)  # before this step's first selection
        cache.write(layer, k, v)
        return read_rows(cache, layer, q, k, v, st.reads, rows, step)
