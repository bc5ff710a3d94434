"""Double Sparsity's view of the cache for a draft (``kv_draft`` ``double_sparsity``; Yang et al., 2024).

Once the prompt is in, the prompt's last ``observe`` tokens run as draft rows, and each
full-attention layer's *label channels* are picked from their queries and their own keys (the
``r`` channels with the largest mean ``|q_c k_c|`` per KV head:
:func:`~speculum.kv.double_sparsity.label_channels`); the label channels of the committed keys
from the sinks up to the recent window are copied into a small *label cache*. Every draft forward
then scores those entries with the label channels alone (a softmax of the approximate logits per
query head, summed over the KV head's query heads and the rows) and reads the ``tokens`` best per
KV head in full, with the sinks and every entry committed since the label cache was taken (the
policy's rule, :class:`~speculum.kv.double_sparsity.DoubleSparsityPolicy`, which picks per row).

Shapes: ``n`` rows, ``H`` query heads, ``H_kv`` KV heads, ``g = H / H_kv``, ``d`` the head size,
``r`` label channels, ``B`` entries in the label cache.
"""

from __future__ import annotations

import torch

from ..attention import fold_queries
from ..kv.double_sparsity import DoubleSparsityPolicy, label_channels
from ..kv.scoring import top_slots


def labels_of(queries: torch.Tensor, own_keys: torch.Tensor, keys: torch.Tensor,
              r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Label channels from ``queries [w, H, d]`` and their own keys ``own_keys [H_kv, w, d]``, and the
    label cache of ``keys [H_kv, B, d]``: ``(channels [H_kv, r], label keys [H_kv, B, r])``."""
    channels = label_channels(queries, own_keys, r)
    return channels, DoubleSparsityPolicy.gather_labels(keys, channels, keys.shape[1])


def label_top(q: torch.Tensor, channels: torch.Tensor, label_keys: torch.Tensor, scale: float,
              tokens: int) -> torch.Tensor:
    """The ``tokens`` label-cache entries per KV head that rows ``q [n, H, d]`` attend to most by
    their label channels: indices into the label cache ``[H_kv, tokens]``, increasing."""
    kv_heads, entries = label_keys.shape[0], label_keys.shape[1]
    qg = fold_queries(q, kv_heads)  # [H_kv, g*n, d]
    q_label = qg.gather(2, channels[:, None, :].expand(-1, qg.shape[1], -1))  # [H_kv, g*n, r]
    approx = torch.matmul(q_label, label_keys.transpose(1, 2)).float().mul_(scale)  # [H_kv, g*n, B]
    votes = approx.view(kv_heads, -1, q.shape[0], entries).softmax(-1).sum((1, 2))  # [H_kv, B]
    return top_slots(votes, min(tokens, entries))
