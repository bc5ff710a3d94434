"""What the merging policies (D2O, Chelsea) share: cosine similarity of keys, the slots a selection
leaves out, and a weighted merge of entries into the entries they are most similar to.

Shapes: ``kv [2, H_kv, L, d]`` (keys, values) of one layer; slot indices ``[H_kv, m]`` per KV head.
Example (one head, ``d = 1`` for clarity): kept entries ``k = [[1.0], [4.0]]`` with weight 1 each,
one entry ``[2.0]`` of weight 1 merged into slot 0 -> ``[[1.5], [4.0]]``; slot 1, which nothing
joined, keeps its exact bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every row of ``a [..., e, d]`` with every row of ``b [..., m, d]`` ->
    ``[..., e, m]`` float32."""
    return torch.matmul(F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1).transpose(-1, -2))


def left_out(idx: torch.Tensor, length: int) -> torch.Tensor:
    """The slots of ``0 .. length-1`` not in ``idx [H, m]`` (distinct per row), increasing ->
    ``[H, length - m]``."""
    kept = torch.zeros((idx.shape[0], length), dtype=torch.bool, device=idx.device).scatter_(1, idx, True)
    return (~kept).nonzero()[:, 1].view(idx.shape[0], length - idx.shape[1])


def take(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Entries ``idx [H, m]`` of ``kv [2, H, L, d]`` -> ``[2, H, m, d]``."""
    return kv.gather(2, idx[None, :, :, None].expand(2, -1, -1, kv.shape[-1]))


def put_back(kv: torch.Tensor, idx: torch.Tensor, entries: torch.Tensor) -> None:
    """Write ``entries [2, H, m, d]`` into slots ``idx [H, m]`` of ``kv [2, H, L, d]``, in place."""
    kv.scatter_(2, idx[None, :, :, None].expand(2, -1, -1, kv.shape[-1]), entries.to(kv.dtype))


def weighted_merge(dst: torch.Tensor, dst_w: torch.Tensor, src: torch.Tensor, src_w: torch.Tensor,
                   into: torch.Tensor) -> torch.Tensor:
    """Merge entries ``src [2, H, e, d]`` (weights ``src_w [H, e]``, 0 = not merged) into entries
    ``dst [2, H, m, d]`` (weights ``dst_w [H, m]``, positive), each into ``dst`` entry ``into [H, e]``:
    every ``dst`` entry becomes the weighted mean of itself and what joined it -> ``[2, H, m, d]``
    float32. Entries nothing joined are returned exactly as they were."""
    d = dst.shape[-1]
    num = dst.float() * dst_w[None, :, :, None]
    num.scatter_add_(2, into[None, :, :, None].expand(2, -1, -1, d), src.float() * src_w[None, :, :, None])
    den = dst_w.scatter_add(1, into, src_w)  # [H, m]
    joined = (den != dst_w)[None, :, :, None]
    return torch.where(joined, num / den[None, :, :, None], dst.float())
