"""Layer-by-layer prefill: the prompt passes through one layer at a time, so a KV policy stores
what it keeps of each layer before the next layer runs and the full cache never exists at once.

Inside a layer the prompt runs in chunks of ``chunk`` tokens with the same operations, shapes
and masks as the native runner's chunked prefill (which goes chunk by chunk through all layers),
so a policy that keeps everything gets bit-identical keys, values and logits.
"""

from __future__ import annotations

import torch

from ..attention import attention_probs, attention_scores, fold_queries, grouped, visibility, window_skip
from ..cache.store import put
from ..kv.scoring import observation_weights

SCORE_ROWS = 32  # prompt queries per slice when accumulating attention (H2O)
WINDOW = ("window", "window_rows")  # the score kinds read from the last prompt queries' attention
TAIL = (*WINDOW, "queries")  # the kinds that keep some prompt queries


@torch.inference_mode()
def prefill_layerwise(decoder, ids: list[int], chunk: int, scores: str | None, window_rows: int | torch.Tensor,
                      store, vote=None, attend=None) -> torch.Tensor:
    """Run ``ids`` (``n`` tokens at positions ``0 .. n-1``) through ``decoder``.

    Args:
        scores: None, ``"window"``: per token, the attention the last ``window_rows`` prompt tokens
            pay it, summed over those queries and the query heads of each KV group; ``"window_rows"``:
            those attention weights unsummed, ``[H_kv, g*w, n]`` (folded rows: query ``i`` of head
            ``j`` of a group is row ``j*w + i``; CAKE's dispersion statistics); ``"all"``: the
            summed attention of every prompt token (accumulated attention, H2O); ``"logits"``: what
            ``vote`` makes of every prompt token's attention logits, summed over the prompt
            (Keyformer); ``"queries"``: the queries themselves, ``[w, H, d]`` (after rotary embedding)
            of the prompt rows ``window_rows [w]`` (increasing; Double Sparsity's and ThinK's channel
            statistics, ZipCache's probes). Scores are computed for full-attention layers only;
            queries are given for every layer.
        store: ``store(layer, sliding, kv [2, H_kv, n, d], scores)``, called once per layer when its
            keys and values are complete (``scores [H_kv, n]``, ``[H_kv, g*w, n]``, ``[w, H, d]`` or None).
    Returns the last token's logits ``[1, V]``.
    """
    s = decoder.shape
    dev = decoder.device
    n = len(ids)
    positions = torch.arange(n, device=dev)
    h = decoder.embed_ids(torch.tensor(ids, device=dev))
    rope = decoder.rope(positions)
    spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    rows = window_rows if scores == "queries" else torch.arange(max(0, n - window_rows), n)  # [w] queries kept
    rows = rows.to(dev)
    causal = ChunkCausalMask(n, chunk, s.group, decoder.dtype, dev) if n > chunk else None
    for i, layer in enumerate(decoder.layers):
        buf = torch.empty((2, s.kv_heads, n, s.head_dim), dtype=decoder.dtype, device=dev)
        want = None if layer.sliding and scores != "queries" else scores
        acc = torch.zeros((s.kv_heads, n), dtype=torch.float32, device=dev) if want in ("all", "logits") else None
        tail: list[torch.Tensor] = []
        for a, b in spans:
            shared = causal is not None and not layer.sliding and b - a == chunk
            if shared:
                mask = causal.over(a, b)
            else:  # sliding-window layers and a short last chunk: built for this chunk and layer
                vis = visibility(a, positions[a:b], None, s.sliding_window)[layer.sliding]
                mask = grouped(vis, s.group, decoder.dtype)
            kept = rows[(rows >= a) & (rows < b)] - a if want in TAIL else None
            chunk_store = ChunkStore(decoder, buf, a, b, mask, acc, tail, kept, vote if want == "logits" else None,
                                     attend)
            part = {kind: (cos[a:b], sin[a:b]) for kind, (cos, sin) in rope.items()}
            h[a:b] = decoder.layer_forward(i, layer, h[a:b], part, chunk_store)
            if shared:
                causal.release(a, b)
        layer_scores = acc
        if want == "queries":
            layer_scores = torch.cat(tail) if tail else h.new_empty((0, s.heads, s.head_dim))  # [w, H, d]
        elif want in WINDOW:  # the queries of rows, [w, H, d]
            layer_scores = observation_weights(torch.cat(tail), rows, buf[0], s.attn_scale, s.attn_softcap)
            if want == "window":
                layer_scores = layer_scores.sum(1)
        store(i, layer.sliding, buf, layer_scores)
    return decoder.logits(h[-1:])


class ChunkCausalMask:
    """Full-attention masks of whole prompt chunks, as views of one buffer that every chunk and layer shares.

    The mask of chunk ``a .. b-1`` (``b - a == chunk``) over keys ``0 .. b-1`` is additive and
    folded (:func:`~speculum.attention.grouped`): ``[g*chunk, b]``, zero over the keys before the
    chunk and causal over its own. :meth:`over` returns it as the view ``buf[:, :b]`` of a zeroed
    ``[g*chunk, n]`` buffer with the causal block written at ``a .. b-1``; :meth:`release` zeroes
    that block again. The values equal the per-chunk masks; building those afresh for every chunk
    of every layer allocated ``g*chunk*b`` elements each time (6 MB per chunk and layer at 4k tokens
    for SmolLM2), which the allocator kept resident and fragmented.
    """

    def __init__(self, n: int, chunk: int, group: int, dtype: torch.dtype, device) -> None:
        self.buf = torch.zeros((group * chunk, n), dtype=dtype, device=device)
        self.block = grouped(torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(), group, dtype)

    def over(self, a: int, b: int) -> torch.Tensor:
        self.buf[:, a:b] = self.block
        return self.buf[:, :b]

    def release(self, a: int, b: int) -> None:
        self.buf[:, a:b] = 0


class ChunkStore:
    """One prompt chunk's :class:`~speculum.cache.store.KVStore` in one layer: its entries go to
    ``a .. b-1`` of the layer's buffer ``buf [2, H_kv, n, d]`` and it attends over ``0 .. b-1`` (a sliding
    layer from :func:`~speculum.attention.window_skip` on); its
    attention (or, given ``vote``, its vote on the attention logits) is added to ``acc [H_kv, n]``
    and the queries of its rows ``kept [k]`` (indices within the chunk) appended to ``tail`` where
    those are given; ``attend`` (see :func:`prefill_layerwise`) may compute the attention instead."""

    compiled = None

    def __init__(self, decoder, buf, a: int, b: int, mask, acc, tail, kept, vote=None, attend=None):
        self.decoder, self.buf, self.a, self.b, self.mask = decoder, buf, a, b, mask
        self.acc, self.tail, self.kept, self.vote, self.policy_attend = acc, tail, kept, vote, attend

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        decoder, buf, a, b, mask = self.decoder, self.buf, self.a, self.b, self.mask
        put(buf, a, k, v)
        if self.acc is not None:  # in slices of query rows: the float32 weights of a whole chunk would be g*256*b
            m, g = q.shape[0], decoder.shape.group
            for r in range(0, m, SCORE_ROWS):
                rows = None if mask is None else mask.view(g, m, -1)[:, r:r + SCORE_ROWS].reshape(-1, mask.shape[-1])
                if self.vote is None:
                    self.acc[:, :b] += attention_probs(q[r:r + SCORE_ROWS], buf[0, :, :b], rows, decoder.shape.attn_scale,
                                                       decoder.shape.attn_softcap).sum(1)
                else:
                    self.acc[:, :b] += self._vote(layer, q[r:r + SCORE_ROWS], rows, a + r)
        if self.kept is not None and self.kept.numel():
            self.tail.append(q.index_select(0, self.kept))
        if self.policy_attend is not None:
            out = self.policy_attend(layer, sliding, q, buf, a, b, mask)
            if out is not None:
                return out
        lo = window_skip(a, decoder.shape.sliding_window) if sliding else 0  # keys a window behind: unseen
        if lo:
            mask = None if mask is None else mask[..., lo:]
        return decoder.attend(q, buf[0, :, lo:b], buf[1, :, lo:b], mask)

    def _vote(self, layer: int, q: torch.Tensor, mask: torch.Tensor | None, first: int) -> torch.Tensor:
        """``vote`` of the rows ``q [r, H, d]`` at positions ``first ..`` over keys ``0 .. b-1`` -> ``[H_kv, b]``."""
        s, keys = self.decoder.shape, self.buf[0, :, : self.b]
        logits = attention_scores(fold_queries(q, s.kv_heads), keys, mask, s.attn_scale, s.attn_softcap)
        return self.vote(layer, logits, torch.arange(first, first + q.shape[0], device=q.device))
