"""Layer-by-layer prefill: the prompt passes through one layer at a time, so a KV policy stores
what it keeps of each layer before the next layer runs and the full cache never exists at once.

Inside a layer the prompt runs in chunks of ``chunk`` tokens with the same operations, shapes
and masks as the native runner's chunked prefill (which goes chunk by chunk through all layers),
so a policy that keeps everything gets bit-identical keys, values and logits.
"""

from __future__ import annotations

import torch

from ..attention import attention_probs, grouped, visibility
from ..cache.store import put

SCORE_ROWS = 32  # prompt queries per slice when accumulating attention (H2O)


@torch.inference_mode()
def prefill_layerwise(decoder, ids: list[int], chunk: int, scores: str | None, window_rows: int, store,
                      attend=None) -> torch.Tensor:
    """Run ``ids`` (``n`` tokens at positions ``0 .. n-1``) through ``decoder``.

    Args:
        scores: None, ``"window"``: per token, the attention the last ``window_rows`` prompt tokens
            pay it, summed over those queries and the query heads of each KV group; ``"all"``: the
            same over every prompt token (accumulated attention, H2O). Computed for full-attention
            layers only.
        store: ``store(layer, sliding, kv [2, H_kv, n, d], scores [H_kv, n] | None)``, called once
            per layer when its keys and values are complete.
    Returns the last token's logits ``[1, V]``.
    """
    s = decoder.shape
    dev = decoder.device
    n = len(ids)
    positions = torch.arange(n, device=dev)
    h = decoder.embed_ids(torch.tensor(ids, device=dev))
    rope = decoder.rope(positions)
    spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    w0 = max(0, n - window_rows)
    causal = ChunkCausalMask(n, chunk, s.group, decoder.dtype, dev) if n > chunk else None
    for i, layer in enumerate(decoder.layers):
        buf = torch.empty((2, s.kv_heads, n, s.head_dim), dtype=decoder.dtype, device=dev)
        want = None if layer.sliding else scores
        acc = torch.zeros((s.kv_heads, n), dtype=torch.float32, device=dev) if want == "all" else None
        tail: list[torch.Tensor] = []
        for a, b in spans:
            shared = causal is not None and not layer.sliding and b - a == chunk
            if shared:
                mask = causal.over(a, b)
            else:  # sliding-window layers and a short last chunk: built for this chunk and layer
                vis = visibility(a, positions[a:b], None, s.sliding_window)[layer.sliding]
                mask = grouped(vis, s.group, decoder.dtype)
            chunk_store = ChunkStore(decoder, buf, a, b, mask, acc, tail if want == "window" and b > w0 else None, w0,
                                     attend)
            part = {kind: (cos[a:b], sin[a:b]) for kind, (cos, sin) in rope.items()}
            h[a:b] = decoder.layer_forward(i, layer, h[a:b], part, chunk_store)
            if shared:
                causal.release(a, b)
        layer_scores = acc
        if want == "window":
            qw = torch.cat(tail)  # [w, H, d], the queries of positions w0 .. n-1
            vis = torch.arange(n, device=dev)[None, :] <= positions[w0:, None]  # causal [w, n]
            layer_scores = attention_probs(qw, buf[0], grouped(vis, s.group, torch.float32), s.attn_scale,
                                           s.attn_softcap).sum(1)
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
    ``a .. b-1`` of the layer's buffer ``buf [2, H_kv, n, d]`` and it attends over ``0 .. b-1``; its
    attention is added to ``acc [H_kv, n]`` and the queries of positions ``w0 ..`` kept in ``tail``
    where those are given; ``attend`` (see :func:`prefill_layerwise`) may compute the attention instead."""

    compiled = None

    def __init__(self, decoder, buf, a: int, b: int, mask, acc, tail, w0: int, attend=None):
        self.decoder, self.buf, self.a, self.b, self.mask = decoder, buf, a, b, mask
        self.acc, self.tail, self.w0, self.policy_attend = acc, tail, w0, attend

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        decoder, buf, a, b, mask = self.decoder, self.buf, self.a, self.b, self.mask
        put(buf, a, k, v)
        if self.acc is not None:  # in slices of query rows: the float32 weights of a whole chunk would be g*256*b
            m, g = q.shape[0], decoder.shape.group
            for r in range(0, m, SCORE_ROWS):
                rows = None if mask is None else mask.view(g, m, -1)[:, r:r + SCORE_ROWS].reshape(-1, mask.shape[-1])
                self.acc[:, :b] += attention_probs(q[r:r + SCORE_ROWS], buf[0, :, :b], rows, decoder.shape.attn_scale,
                                                   decoder.shape.attn_softcap).sum(1)
        if self.tail is not None:
            self.tail.append(q[max(0, self.w0 - a):])
        if self.policy_attend is not None:
            out = self.policy_attend(layer, sliding, q, buf, a, b, mask)
            if out is not None:
                return out
        return decoder.attend(q, buf[0, :, :b], buf[1, :, :b], mask)
