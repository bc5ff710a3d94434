"""Repetition, frequency and presence penalties, applied to every row of a verification step along
its own path through the draft tree.

The penalties of one position depend on the tokens before it: the prompt and the output so far
(``repetition_penalty``, as transformers' and vLLM's: a logit ``x`` of a token seen anywhere becomes
``x / r`` where ``x > 0`` and ``x * r`` elsewhere) and the output alone (OpenAI's
``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``: ``x - f * count - p * (count > 0)``),
applied in that order, as vLLM does. A verification step computes the logits after the root and
after every drafted node at once, so row ``i + 1`` (after node ``i``) must see the output extended
by node ``i``'s path (its ancestors and itself), not by the whole tree; row 0 (after the root) sees
the output as committed. Plain decoding applies the same rule to its one row, so speculative
output stays exactly plain decoding's, greedy or sampled.

Example: output so far ``[7, 7]``, tree ``[5, 7]`` with node 1 a child of node 0, ``f = 0.5``:
row 0 subtracts 1.0 from token 7; row 1 (after 5) 1.0 from 7 and 0.5 from 5; row 2 (after 5, 7)
1.5 from 7 and 0.5 from 5.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling import SamplingParams
from .tree import DraftTree


class Penalties:
    """One request's penalty state: counts ``[V]`` of its output tokens, and which tokens its prompt
    and output hold (for the repetition penalty)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, device: torch.device):
        self.params = params
        self.counts = torch.zeros(vocab_size, device=device)  # [V] output token counts
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] in the prompt or output
        self.seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens just added to the output."""
        if tokens:
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=ids.device))
            self.seen[ids] = True

    def apply(self, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """``logits [n + 1, V]`` of the rows ``[root] + tree`` -> penalised float32 logits (same shape).
        Only the state the request's penalties read is extended by the rows' paths."""
        p, out = self.params, logits.float()
        rows, toks = self._path_tokens(tree, logits.device)
        if p.repetition_penalty != 1.0:
            seen = self.seen.expand(len(tree) + 1, -1)
            if rows is not None:
                seen = seen.clone().index_put_((rows, toks), torch.ones(len(rows), dtype=torch.bool, device=out.device))
            out = torch.where(seen, torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty), out)
        if p.frequency_penalty or p.presence_penalty:
            counts = self.counts.expand(len(tree) + 1, -1)
            if rows is not None:
                counts = counts.clone().index_put_((rows, toks), torch.ones(len(rows), device=out.device),
                                                   accumulate=True)
            out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        return out

    @staticmethod
    def _path_tokens(tree: DraftTree, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(rows, tokens)``, one entry per node on each row's path (row ``r`` of ``[root] + tree``
        and the token of a node that is ``r``'s node or one of its ancestors), or ``(None, None)``
        for an empty tree."""
        if not len(tree):
            return None, None
        on_path = torch.from_numpy(tree.ancestor_mask_np()[:, 1:])  # [n + 1, n]: node j on row r's path
        rows, nodes = on_path.nonzero(as_tuple=True)
        toks = torch.tensor(tree.tokens, dtype=torch.long)[nodes]
        return rows.to(device), toks.to(device)
