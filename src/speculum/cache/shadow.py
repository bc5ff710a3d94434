"""ShadowKV's cache (Sun et al., 2024): the prompt's keys as a low-rank factorisation of their pre-RoPE
form, read back only for the chunks a step selects, plus whole entries for the rest.

The :class:`~speculum.cache.PositionedKVCache` buffer holds the whole entries: in full-attention
layers the outlier chunks and the prompt's last tokens, then every generated token (sliding-window
layers keep their most recent entries there and nothing else). Each full-attention layer's
:class:`Shadow` holds the other prompt tokens, cut into chunks of ``chunk`` tokens:

- keys: pre-RoPE keys ``[T, H_kv * d]`` (all heads side by side) = ``u [T, r] @ sv [r, H_kv * d]``
  (truncated SVD), one landmark per chunk (its mean post-RoPE key) for selection;
- values: whole, in the paper offloaded to CPU memory; on a CPU there is no other memory to put
  them in, so they stay here and count in :meth:`ShadowKVCache.nbytes`.

:meth:`ShadowKVCache.attend_shadow` scores the landmarks with each row's query, takes each row's
best chunks, rebuilds only their keys (``u[tokens] @ sv``, rotated to their positions) and attends
over them and the whole entries under one softmax; every row reads its own choice (the union is
built once, a mask keeps each row to its chunks), as a one-token step at its position would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import (
    AttentionLayout,
    Step,
    attention_parts,
    attention_scores,
    fold_queries,
    grouped,
    rotate,
)
from .positioned import PositionedKVCache


@dataclass
class Shadow:
    """One full-attention layer's compressed prompt chunks (``T`` tokens at positions ``0 .. T-1``;
    ``c`` of their chunks selectable, the outlier chunks being whole entries elsewhere)."""

    u: torch.Tensor  # [T, r] left factors of the pre-RoPE keys, shared by the KV heads
    sv: torch.Tensor  # [H_kv, r, d] right factors (singular values folded in), per head
    landmarks: torch.Tensor  # [H_kv, c, d] mean post-RoPE key of each selectable chunk
    chunk_ids: torch.Tensor  # [H_kv, c] int64 the chunk each landmark stands for
    values: torch.Tensor  # [H_kv, c, chunk, d] the selectable chunks' values

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.u, self.sv, self.landmarks, self.chunk_ids, self.values))


def low_rank_keys(pre: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of pre-RoPE keys ``pre [H_kv, T, d]`` laid side by side (``[T, H_kv * d]``):
    ``u [T, r]`` and ``sv [H_kv, r, d]`` float32, ``r = min(rank, T, H_kv * d)``."""
    heads, t, d = pre.shape
    u, s, vh = torch.linalg.svd(pre.transpose(0, 1).reshape(t, heads * d).float(), full_matrices=False)
    r = min(rank, s.shape[0])
    return u[:, :r], (s[:r, None] * vh[:r]).view(r, heads, d).transpose(0, 1)


class ShadowKVCache(PositionedKVCache):
    """Whole entries + one :class:`Shadow` per full-attention layer (None: everything whole)."""

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int, chunk: int):
        super().__init__(layout, dtype, device, capacity_hint)
        if len(layout.rotary) != layout.layers:
            raise ValueError("ShadowKV needs each layer's rotary embedding (its keys are stored before RoPE)")
        self.chunk = chunk
        self.shadow: list[Shadow | None] = [None] * layout.layers
        self.angles: dict[int, tuple] = {}  # id of a Rotary -> (it, cos, sin): prompt_angles' tables

    def nbytes(self) -> int:
        """Whole entries and every layer's factors, landmarks and values."""
        return super().nbytes() + sum(sh.nbytes() for sh in self.shadow if sh is not None)

    def store_shadow(self, layer: int, kv: torch.Tensor, selectable: torch.Tensor, landmarks: torch.Tensor,
                     rank: int) -> None:
        """Compress the prompt chunks ``kv [2, H_kv, T, d]`` (positions ``0 .. T-1``) of ``layer``: keys by
        :func:`low_rank_keys` of their pre-RoPE form (RoPE undone: :meth:`~speculum.attention.Rotary.shift`
        by minus their positions), values and ``landmarks [H_kv, c, d]`` of the chunks ``selectable
        [H_kv, c]`` kept."""
        heads, t, d = kv.shape[1:]
        keys = kv[0].float().reshape(heads * t, d)
        back = -torch.arange(t, device=kv.device).repeat(heads)
        pre = self.layout.rotary[layer].shift(keys, back).view(heads, t, d)
        u, sv = low_rank_keys(pre, rank)
        chunks = kv[1].unflatten(1, (t // self.chunk, self.chunk))  # [H, T/chunk, chunk, d]
        values = chunks.gather(1, selectable[:, :, None, None].expand(-1, -1, self.chunk, d))
        self.shadow[layer] = Shadow(u.to(self.dtype), sv.to(self.dtype), landmarks.to(self.dtype), selectable,
                                    values.contiguous())

    def rebuild_keys(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys ``[H_kv, m, d]`` of ``layer``'s prompt tokens ``tokens [H_kv, m]`` (their
        positions), from the factors."""
        sh = self.shadow[layer]
        heads, m = tokens.shape
        pre = torch.matmul(sh.u[tokens].float(), sh.sv.float())  # [H, m, d]
        cos, sin = self.prompt_angles(layer)
        at = tokens.flatten()
        return rotate(pre.reshape(heads * m, -1), cos[at], sin[at]).view(heads, m, -1).to(self.dtype)

    def prompt_angles(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, d]`` float32 of :meth:`~speculum.attention.Rotary.shift`'s rotations to the prompt
        positions ``0 .. T-1`` of ``layer``'s shadow, computed once per rotary embedding (the same values
        ``shift`` computes at each call, not recomputed at every step and layer)."""
        rotary, t = self.layout.rotary[layer], self.shadow[layer].u.shape[0]
        hit = self.angles.get(id(rotary))
        if hit is None or hit[1].shape[0] < t:
            freqs = torch.arange(t, device=self.device)[:, None].float() * rotary.inv_freq.to(self.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            hit = self.angles[id(rotary)] = (rotary, emb.cos(), emb.sin())
        return hit[1], hit[2]

    def chosen_chunks(self, layer: int, q: torch.Tensor, select: int) -> torch.Tensor:
        """Each row's choice ``[H_kv, n, c]`` bool among ``layer``'s selectable chunks for ``q [n, H, d]``:
        the ``select`` best per KV head by landmark score (softmax over the landmarks per query head,
        the largest over a KV group's heads)."""
        s, sh, n = self.layout, self.shadow[layer], q.shape[0]
        qg = fold_queries(q, s.kv_heads)  # [H_kv, g*n, d]
        probs = attention_scores(qg, sh.landmarks, None, s.scale, s.softcap).softmax(-1)  # [H_kv, g*n, c]
        best = probs.view(s.kv_heads, s.group, n, -1).amax(1)  # [H_kv, n, c]
        chosen = torch.zeros_like(best, dtype=torch.bool)
        return chosen.scatter_(-1, best.topk(min(select, best.shape[-1]), dim=-1).indices, True)

    def attend_shadow(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
                      select: int) -> torch.Tensor:
        """Write the new entries ``k, v [n, H_kv, d]``; attend ``q [n, H, d]`` over the whole entries and,
        per row and KV head, the ``select`` chunks :meth:`chosen_chunks` names -> ``[n, H*d]``."""
        s, sh, n = self.layout, self.shadow[layer], step.n
        self.write(layer, k, v)
        end = self.length + n
        whole = (self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end], self.mask(layer, False, step), None)
        chosen = self.chosen_chunks(layer, q, select)
        union = chosen.any(1)  # [H_kv, c]
        width = int(union.sum(-1).max())
        cols = torch.sort((~union).to(torch.uint8), dim=-1, stable=True).indices[:, :width]  # [H_kv, width]
        seen = chosen.gather(2, cols[:, None, :].expand(-1, n, -1)) & union.gather(1, cols)[:, None, :]
        tokens = (sh.chunk_ids.gather(1, cols)[..., None] * self.chunk
                  + torch.arange(self.chunk, device=cols.device)).flatten(1)  # [H_kv, width*chunk]
        values = sh.values.gather(1, cols[:, :, None, None].expand(-1, -1, *sh.values.shape[2:])).flatten(1, 2)
        mask = grouped(seen.repeat_interleave(self.chunk, dim=-1), s.group, self.dtype)
        part = (self.rebuild_keys(layer, tokens), values, mask, None)
        return attention_parts(q, [whole, part], s.scale, s.softcap)
