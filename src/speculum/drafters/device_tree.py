"""EAGLE-2's dynamic tree grown on the device in fixed shapes, one CUDA graph per step.

:class:`~speculum.drafting.tree_growth.DynamicTree` grows the tree on the host: after each depth it
reads the head's top-k back (a host synchronisation) and picks the next frontier in Python, so on a
GPU each depth costs a round trip and a few dozen kernel launches. Here the growth is the EAGLE
reference implementation's, in shapes that do not depend on the data:

- the root's ``k`` best tokens are the first depth;
- each further depth expands exactly ``k`` nodes: the best ``k`` of the last depth's candidates by
  path log-probability (at the first depth, all of them). One head forward over ``k`` rows gives each
  its ``k`` best children: ``k * k`` candidates, scored by their path's log-probability;
- a node whose token ends the request (an EOS id) is expanded like the others, its children scored
  ``-inf`` (nothing after it can be committed);
- every node made goes back to the host in one copy, where the tree keeps the best ``max_nodes``
  (as :meth:`DynamicTree.result` does).

The head writes the expanded rows' keys and values into its cache's pending slots ``committed ..
committed + (depth - 1) * k - 1`` (expansion ``d``'s row ``r`` at ``committed + (d - 1) k + r``) and
each row attends the committed entries plus its ancestors' and its own. Attention spans a bucket of
the cache's slots (:data:`~speculum.runners.graphs.KEY_BUCKETS`), masked, so that one capture serves
every cache length of its bucket. On a CUDA device the whole growth (``depth - 1`` head forwards,
``depth`` LM-head products and top-k's) is captured once per bucket and replayed; elsewhere it runs
eagerly in the same shapes (the tests' path).

Unlike the host growth it does not prune paths below a probability floor before expanding them
(the shapes are fixed; such paths rank last anyway), and it looks the best path up in the text once,
after the last depth.
"""

from __future__ import annotations

import numpy as np
import torch

from ..drafting.tree_growth import DynamicTree
from ..runners.graphs import bucket, capture_graph, key_buckets


class DeviceTreeGrowth:
    """The fixed-shape growth of EAGLE-2's tree for one EAGLE head and its cache buffers.

    Args:
        head: a frozen :class:`~speculum.heads.eagle.EagleHead`; ``tables`` the target's
            :class:`~speculum.heads.TargetTables`.
        kv: the head cache's buffer ``[2, H_kv, C, d]`` (its storage must not change while this
            object is used: captured graphs read it).
        top_k: ``k``, the children per node and the nodes expanded per depth; ``depth``: depths drafted.
        ends: token ids whose nodes are not expanded (the request's EOS ids).
        capture: capture CUDA graphs (default: on CUDA devices).
    """

    def __init__(self, head, tables, kv: torch.Tensor, top_k: int, depth: int,
                 ends: frozenset[int] = frozenset(), capture: bool | None = None):
        self.head, self.tables, self.kv = head, tables, kv
        self.k, self.depth = top_k, max(1, depth)
        self.device = kv.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.draft_slots = (self.depth - 1) * top_k  # S: pending cache slots one growth writes
        self.nodes = top_k + (self.depth - 1) * top_k * top_k  # N: nodes one growth makes
        self.key_buckets = key_buckets(kv.shape[2])
        hidden = head.config.hidden
        # static inputs: the root's predicted feature, and [committed, root position]
        self.root_feat = torch.zeros(hidden, dtype=kv.dtype, device=self.device)
        self.scalars = torch.zeros(2, dtype=torch.long, device=self.device)
        self.host_scalars = torch.zeros(2, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.end_ids = ends
        self.ends = torch.tensor(sorted(ends) or [-1], dtype=torch.long, device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, committed: int) -> bool:
        """Whether a growth after ``committed`` cache entries fits the cache."""
        return committed + self.draft_slots <= self.kv.shape[2]

    @torch.inference_mode()
    def grow(self, root_feat: torch.Tensor, root_pos: int, committed: int) -> DynamicTree:
        """The grown tree (host lists, as :class:`DynamicTree` holds them) below a root whose predicted
        feature is ``root_feat [D]`` at position ``root_pos``, after ``committed`` cache entries (the
        caller checked :meth:`fits`). Reads the device once."""
        kb = bucket(committed + self.draft_slots, self.key_buckets)
        self.root_feat.copy_(root_feat)
        self.host_scalars[0], self.host_scalars[1] = committed, root_pos
        self.scalars.copy_(self.host_scalars, non_blocking=True)
        if self.capture:
            if kb not in self.graphs:
                self.graphs[kb] = capture_graph(lambda: self._grow(kb), self.pool)
            graph, packed = self.graphs[kb]
            graph.replay()
        else:
            packed = self._grow(kb)
        tokens, parents, scores = packed.cpu().numpy()  # the one synchronisation
        grow = DynamicTree(self.k)
        grow.tokens = tokens.astype(np.int64).tolist()
        grow.parents = parents.astype(np.int64).tolist()
        grow.scores = scores.astype(np.float64).tolist()
        return grow

    def last_level(self, grow: DynamicTree) -> list[int]:
        """The nodes of the deepest depth that scored above ``-inf``."""
        first = self.nodes - (self.k * self.k if self.depth > 1 else self.k)
        return [i for i in range(first, self.nodes) if grow.scores[i] > -np.inf]

    def _grow(self, kb: int) -> torch.Tensor:
        """The growth over the static inputs: ``[3, N]`` float32 (tokens, parents, scores), the nodes
        in creation order (``-1``: the root's children's parent)."""
        k, S, dev, tables = self.k, self.draft_slots, self.device, self.tables
        committed, root_pos = self.scalars[0], self.scalars[1]
        rows = torch.arange(k, device=dev)
        logp = torch.log_softmax(tables.logits(self.root_feat[None]).float(), dim=-1)  # [1, K]
        top = logp.topk(k, dim=-1)
        front_tok = tables.token_ids(top.indices[0])  # [k] the frontier's tokens
        front_score = top.values[0]  # [k] their path log-probabilities
        front_node = rows.clone()  # [k] their node numbers
        all_tok, all_par, all_score = [front_tok], [torch.full((k,), -1, device=dev)], [front_score]
        parent_feat = self.root_feat[None].expand(k, -1)
        ancestors = torch.zeros(k, max(S, 1), dtype=torch.bool, device=dev)  # [k, S] pending slots seen
        slot_rel = torch.arange(kb, device=dev)[None, :] - committed  # [1, Kb] slot - committed
        in_draft = (slot_rel >= 0) & (slot_rel < S)
        gather_at = slot_rel.clamp(0, max(S, 1) - 1).expand(k, kb)
        for d in range(1, self.depth):
            own = (d - 1) * k + rows  # [k] this expansion's pending slots, relative
            ancestors = ancestors.clone()
            ancestors[rows, own] = True
            visible = (slot_rel < 0) | (in_draft & ancestors.gather(1, gather_at))  # [k, Kb]
            positions = (root_pos + d - 1).expand(k)
            out = self.head.step_static(parent_feat, tables.embeds(front_tok), positions, self.kv,
                                        committed + own, visible)  # [k, D]
            lp = torch.log_softmax(tables.logits(out).float(), dim=-1)  # [k, K]
            top = lp.topk(k, dim=-1)
            ended = torch.isin(front_tok, self.ends)
            child_score = (front_score[:, None] + top.values).masked_fill(ended[:, None], float("-inf")).flatten()
            child_tok = tables.token_ids(top.indices).flatten()  # [k * k]
            base = k + (d - 1) * k * k
            all_tok.append(child_tok)
            all_par.append(front_node.repeat_interleave(k))
            all_score.append(child_score)
            best = child_score.topk(k).indices  # [k] the next frontier among the children
            parent_row = best // k
            front_node, front_tok, front_score = base + best, child_tok[best], child_score[best]
            parent_feat, ancestors = out[parent_row], ancestors[parent_row]
        return torch.stack([torch.cat(all_tok).float(), torch.cat(all_par).float(), torch.cat(all_score)])
