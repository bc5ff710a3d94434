"""speculum's model-free drafters as vLLM speculative proposers (vLLM v1's ``custom_class`` method).

vLLM loads a proposer by class path and calls it once per engine step, for the whole batch::

    vllm serve MODEL --speculative-config '{"method": "custom_class",
        "model": "speculum.integrations.vllm.MixProposer", "num_speculative_tokens": 8}'

The classes: :class:`NgramProposer` (speculum's prompt lookup with adaptive draft length),
:class:`RecyclingProposer` (Token Recycling, speculum's scored variant with token-pair rows),
:class:`MixProposer` (suffix-tree and recycling candidates merged) and :class:`AutoProposer` (a
bandit over mix / ngram / no draft per request, by measured tokens per second). vLLM verifies
chains, so each step's tree is cut to its best root path (:meth:`~speculum.tree.DraftTree.best_chain`)
of at most ``num_speculative_tokens`` tokens. vLLM's verification keeps its output exactly that of
decoding without speculation, whatever is proposed.

vLLM's call (``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)``) names no request,
and its batch rows move as requests finish, so :class:`BatchTracker` recognises each row's request
by its tokens. Take row ``i`` at one step with committed tokens ``t`` and, at the next step, a row
``j`` whose ``sampled_token_ids[j]`` is ``s`` and whose token row holds ``n`` tokens: it is the same
request when ``n == len(t) + len(s)`` and the row starts with ``t``'s first tokens, continues with
``t``'s last ones and ends in ``s``. Each request gets a fork of one drafter (per-request state of
its own, cross-request state shared: suffix trees, the recycling matrix, the bandit's evidence); a
request that is gone from the batch is finished (its text feeds the suffix trees).

Token Recycling learns from the logits of every verified token. vLLM does not pass them to a
proposer, so :meth:`SpeculumProposer.load_model` wraps the model's ``compute_logits`` and keeps the
step's logits ``[sum(drafts_i + 1), V]``: request after request, the root's row then one per
scheduled draft token, as vLLM's rejection sampler reads them. A step whose row count does not
match the drafts proposed is not learnt from.

Under load a verification row is no longer nearly free: drafted tokens whose acceptance score is
below a floor that rises with the batch are dropped (:meth:`BatchTracker.min_score`), and all rows
together draft at most ``SPECULUM_VLLM_DRAFT_BUDGET`` tokens a step, the likeliest kept.

This module imports nothing of vLLM: it runs in vLLM's environment, where speculum is installed
without its dependencies (vLLM pins another transformers): see docs/scale-out.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..drafters import DRAFTERS, Drafter
from ..sampling import SamplingParams
from ..tree import DraftTree
from ..verify import Acceptance

# drafted nodes a drafter may grow per step before its tree is cut to one chain
TREE_BUDGET = 64
# tokens compared at each end of a row to recognise its request
CHECK = 32
# drafted tokens per engine step, all rows together (env SPECULUM_VLLM_DRAFT_BUDGET; 0: no limit)
DRAFT_BUDGET = 32
# with this many requests in the batch a drafted token needs this acceptance score to be verified
# (linear from 0 at one request; BatchTracker.min_score): on a 2-core CPU a 16-row forward of the
# default model is compute-bound, one more row costing ~0.8 of a committed token's time
FULL_BATCH = int(os.environ.get("SPECULUM_VLLM_FULL_BATCH", "16"))
FULL_BATCH_SCORE = float(os.environ.get("SPECULUM_VLLM_FULL_BATCH_SCORE", "0.8"))
# a log line with the proposer's counts every this many steps (env SPECULUM_VLLM_LOG_EVERY; 0: never)
LOG_EVERY = int(os.environ.get("SPECULUM_VLLM_LOG_EVERY", "0"))
logger = logging.getLogger("vllm.speculum")  # under vLLM's logger, so its handlers print it


@dataclass
class Live:
    """One request in vLLM's batch, as this proposer follows it."""

    drafter: Drafter
    tokens: list[int]  # committed tokens: prompt + output so far
    chain: DraftTree = field(default_factory=DraftTree)  # the draft proposed at the last step

    def cut(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of this step's chain."""
        if keep < len(self.chain):
            self.chain = self.chain.subtree(list(range(keep)))

    def same_row(self, row: np.ndarray, n: int, sampled: list[int]) -> bool:
        """Whether ``row[:n]`` (a vLLM token row) is this request after committing ``sampled``."""
        m = len(self.tokens)
        if n != m + len(sampled) or m == 0:
            return False
        head, tail = min(CHECK, m), max(0, m - CHECK)
        return (row[:head].tolist() == self.tokens[:head] and row[tail:m].tolist() == self.tokens[tail:]
                and row[m:n].tolist() == sampled)


class BatchTracker:
    """Drafts for every row of vLLM's batch, keeping one :class:`Live` per request.

    ``make`` builds the root drafter; requests run on its forks. ``k``: most tokens per chain;
    ``max_model_len``: no draft runs past it.
    """

    def __init__(self, root: Drafter, k: int, max_model_len: int, budget: int | None = None):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if budget is not None and budget < 1:
            raise ValueError(f"the draft token budget must be >= 1, got {budget}")
        self.root, self.k, self.max_model_len, self.budget = root, k, max_model_len, budget
        self.full_batch, self.full_batch_score = FULL_BATCH, FULL_BATCH_SCORE
        self.rows: dict[int, Live] = {}  # batch row -> request, as of the last step
        self.params = SamplingParams()  # drafters draft point masses: vLLM verifies any sampling
        self.started = self.finished = 0
        self.steps = self.learnt = 0  # steps, and steps whose logits were matched to the rows
        self.seconds = 0.0  # spent in step()

    def _find(self, i: int, row: np.ndarray, n: int, sampled: list[int], claimed: set[int]) -> Live | None:
        """The request of last step's rows that row ``i`` continues (its own row first), not one
        another row already ``claimed`` (two requests with the same text stay two)."""
        own_first = sorted(self.rows.items(), key=lambda item: item[0] != i)  # (a stable sort)
        return next((live for _, live in own_first if id(live) not in claimed and live.same_row(row, n, sampled)),
                    None)

    def step(self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray,
             logits: list[torch.Tensor] = ()) -> list[list[int]]:
        """One engine step: learn what the last drafts got, then draft the next chains.

        ``sampled_token_ids``: per row, the tokens committed this step (accepted drafts and the
        bonus token; empty for a row still in prefill); ``num_tokens`` ``[rows]``: committed tokens
        per row, these included; ``token_ids`` ``[rows, max_len]``: the rows' tokens; ``logits``:
        the logits the model computed since the last step, the latest first that is the step's
        ``[sum over rows of (drafts scheduled + 1), V]``. Returns one chain per row.
        """
        found: list[Live | None] = []
        claimed: set[int] = set()
        for i, sampled in enumerate(sampled_token_ids):
            live = self._find(i, token_ids[i], int(num_tokens[i]), sampled, claimed) if sampled else None
            if live is not None:
                claimed.add(id(live))
            found.append(live)
        row_logits = self._split(logits, sampled_token_ids, found)
        self.steps += 1
        self.learnt += any(x is not None for x in row_logits)

        rows: dict[int, Live] = {}
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # prefill not done, or vLLM skipped the row: nothing to draft
                continue
            n = int(num_tokens[i])
            live = found[i]
            if live is None:
                live = self._start(token_ids[i, :n].tolist(), len(sampled))
            else:
                self._learn(live, sampled, row_logits[i])
            rows[i] = live
            self._draft(live, n)
        self._cut_unlikely(rows)
        if self.budget is not None:
            self._fit_budget(rows)
        kept = {id(live) for live in rows.values()}
        for live in self.rows.values():
            if id(live) not in kept:
                live.drafter.finish(live.tokens)
                self.finished += 1
        self.rows = rows
        return [list(rows[i].chain.tokens) if i in rows else [] for i in range(len(sampled_token_ids))]

    def _start(self, tokens: list[int], new: int) -> Live:
        drafter = self.root.fork()
        drafter.reset(tokens[:len(tokens) - new], self.params, None)
        self.started += 1
        return Live(drafter, tokens)

    def _learn(self, live: Live, sampled: list[int], logits: torch.Tensor | None) -> None:
        live.tokens.extend(sampled)
        chain = live.chain
        if logits is not None and logits.shape[0] - 1 < len(chain):  # vLLM scheduled fewer drafts
            chain = chain.subtree(list(range(logits.shape[0] - 1)))
        accepted = min(len(sampled) - 1, len(chain))
        live.drafter.update(live.tokens, chain, Acceptance(list(range(accepted)), list(sampled)), logits)

    def _draft(self, live: Live, n: int) -> None:
        """``live.chain``: the best root path of the drafter's tree, at most ``k`` tokens and none
        past the model length (``n`` committed tokens)."""
        room = min(self.k, self.max_model_len - n - 1)
        if room <= 0:
            live.chain = DraftTree()
            return
        live.chain = live.drafter.propose(live.tokens, TREE_BUDGET).best_chain()
        live.cut(room)

    def _cut_unlikely(self, rows: dict[int, Live]) -> None:
        """Drop drafted tokens whose acceptance score is below :meth:`min_score` for this batch size
        (drafters without scores keep theirs)."""
        floor = self.min_score(len(rows))
        if floor <= 0:
            return
        for live in rows.values():
            scores = live.chain.scores
            if scores is not None:
                live.cut(next((d for d, p in enumerate(scores) if p < floor), len(scores)))

    def min_score(self, rows: int) -> float:
        """The least acceptance score worth a verification row with ``rows`` requests in the batch:
        0 for one request (a row costs a few percent of a step), rising linearly to
        ``full_batch_score`` at ``full_batch`` requests, where a forward is compute-bound and each
        row costs about as much as a token is worth."""
        return self.full_batch_score * min(1.0, (rows - 1) / max(1, self.full_batch - 1))

    def _fit_budget(self, rows: dict[int, Live]) -> None:
        """Cut the chains to ``budget`` drafted tokens in all, keeping the tokens likeliest to be
        accepted across rows: by the drafter's scores where it gives them, else by depth (a chain's
        first tokens before any row's later ones). Under load, verifying a token costs another
        row of a forward that is no longer nearly free."""
        if sum(len(live.chain) for live in rows.values()) <= self.budget:
            return
        ranked = []  # (-score, depth, row)
        for i, live in rows.items():
            scores = live.chain.scores or [0.9 ** (d + 1) for d in range(len(live.chain))]
            ranked += [(-p, d, i) for d, p in enumerate(scores)]
        ranked.sort()
        keep = dict.fromkeys(rows, 0)
        for _, d, i in ranked[:self.budget]:
            keep[i] = max(keep[i], d + 1)  # scores fall along a chain, so the kept ones are a prefix
        for i, live in rows.items():
            live.cut(keep[i])

    @staticmethod
    def _split(logits: list[torch.Tensor], sampled_token_ids: list[list[int]],
               found: list[Live | None]) -> list[torch.Tensor | None]:
        """The step's logits (the latest of ``logits`` with one row per root and draft token) cut
        into each row's ``[drafts + 1, V]`` block; Nones where none adds up (drafts vLLM trimmed,
        a row vLLM skipped)."""
        sizes = [len(live.chain) + 1 if live is not None else 1 for live in found]
        for block in logits:
            if block.dim() == 2 and block.shape[0] == sum(sizes):
                return list(torch.split(block, sizes))
        return [None] * len(sampled_token_ids)


class SpeculumProposer:
    """A vLLM ``custom_class`` proposer running one speculum drafter (``drafter`` of the registry)."""

    drafter = "auto"
    # whether the drafter learns from the target's logits (Token Recycling does)
    reads_logits = True

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        budget = os.environ.get("SPECULUM_VLLM_DRAFT_BUDGET", str(DRAFT_BUDGET))
        self.tracker = BatchTracker(DRAFTERS[self.drafter].factory(), spec.num_speculative_tokens,
                                    vllm_config.model_config.max_model_len, int(budget) if budget != "0" else None)
        self._logits: deque[torch.Tensor] = deque(maxlen=4)  # compute_logits' outputs since the last step

    def load_model(self, model, *args, **kwargs) -> None:
        """Called by vLLM with the target; wraps its ``compute_logits`` to keep each step's logits."""
        if not self.reads_logits or not hasattr(model, "compute_logits"):
            return
        compute = model.compute_logits

        def compute_and_keep(*a, **kw):
            out = compute(*a, **kw)
            if isinstance(out, torch.Tensor):
                self._logits.append(out)
            return out

        model.compute_logits = compute_and_keep

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **kwargs) -> list[list[int]]:
        """vLLM's call: ``sampled_token_ids`` per row; ``num_tokens_no_spec`` ``[rows]``;
        ``token_ids_cpu`` ``[max_rows, max_model_len]``. Returns a chain (maybe empty) per row."""
        logits = list(reversed(self._logits))
        self._logits.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            drafts = self.tracker.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, logits)
        t = self.tracker
        t.seconds += time.perf_counter() - start
        if LOG_EVERY and t.steps % LOG_EVERY == 0:
            logger.info("speculum %s proposer: %d steps (%d with logits matched, %.2f ms each), %d requests "
                        "started, %d finished", self.drafter, t.steps, t.learnt, 1e3 * t.seconds / t.steps,
                        t.started, t.finished)
        return drafts


class NgramProposer(SpeculumProposer):
    """speculum's prompt lookup: incremental n-gram index, draft length adapted per request."""

    drafter = "ngram"
    reads_logits = False


class RecyclingProposer(SpeculumProposer):
    """Token Recycling: candidates from the top-k of the logits last computed after each token."""

    drafter = "recycling_scored"


class MixProposer(SpeculumProposer):
    """suffix-tree (across requests) and Token Recycling candidates merged; the best chain of them."""

    drafter = "mix"


class AutoProposer(SpeculumProposer):
    """A bandit over mix / ngram / no draft, per request, by measured tokens per second."""

    drafter = "auto"


PROPOSERS = {cls.drafter if cls.drafter != "recycling_scored" else "recycling": cls
             for cls in (NgramProposer, RecyclingProposer, MixProposer, AutoProposer)}
