"""``pearl``: the draft model drafts the next chunk while the target verifies the current one
(PEARL: Liu et al. 2024, "PEARL: Parallel Speculative Decoding with Adaptive Draft Length",
https://arxiv.org/abs/2408.11850).

Plain speculative decoding alternates: the draft model drafts ``gamma`` tokens, then the target
verifies them, each waiting for the other. PEARL runs both at once with two rules:

- *post-verify*: while the target verifies the chunk ``d1 .. dk``, the draft model goes on
  drafting after ``dk`` as if every token were accepted. If the target accepts the whole chunk
  and its bonus token equals the draft's first continuation token ``c1``, the rest of the
  continuation ``c2 ..`` is the next chunk, ready when verification ends; otherwise it is dropped.
- *pre-verify*: after a rejection the target verifies the first drafted token while the draft
  drafts the rest of the chunk, so a wrong first token costs no full chunk.

Both make the draft length adapt: the draft drafts for as long as the target verifies. The
paper's window ``gamma`` is the ratio of one target forward's time to one draft forward's.

Here post-verify runs in a background thread (torch's operators and speculum's GGUF kernels
release the GIL, so on a CPU the draft takes one core while the target's verification takes the
other; set ``torch.set_num_threads(1)``, which holds for every thread, so that the two do not
compete). The continuation runs until :meth:`update` says the verification is over
(``gamma=None``, the paper's adaptive length), or for ``gamma`` tokens (fixed chunks,
deterministic). A chunk drafted
after a rejection is drafted in the foreground, ``gamma`` tokens long, where ``gamma=None`` takes
the measured ratio of verification time to draft-token time (the paper's rule).

Pre-verify (``pre_verify``, default on) runs through the same thread: where no chunk is ready (a
request's first step, or after a rejection) only the first token is drafted in the foreground and
proposed alone; the rest of the chunk is the continuation the draft writes while the target
verifies that token. The target's forward over the one token both verifies it and gives the bonus
token after it, so the rest of the chunk is used exactly when the token is accepted and the bonus is
the continuation's first token, as in post-verify; a rejected first token wastes only the draft
forwards that ran beside the target's. ``pre_verify=False`` drafts a fresh chunk whole in the
foreground, as ``draft_model`` does.

Verification is the engine's usual one, so the output is exactly the target's (greedy) or
distributed as the target's (sampled: the continuation is sampled from the draft's q with a
generator of its own, q attached to the tree). A separate draft model is needed: a self-draft
that writes into the target's cache cannot run while the target does.

Example (greedy, ``gamma=3``): root "The"; the draft drafts "cat sat on" in the foreground, then,
while the target verifies it, drafts "the mat ." after "on". The target accepts "cat sat on" and
its bonus is "the" = the continuation's first token, so the next step's chunk is "mat ." at once,
without a draft forward; the draft goes on after "." while the target verifies "mat .".

Shapes: ``V`` the vocabulary; the chain's draft probabilities ``q`` are ``[k, V]`` (sampled only).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import SpeculumError
from ..tree import DraftTree
from ..verify import Acceptance
from .draft_model import DraftModelDrafter


@dataclass
class Chunk:
    """Tokens drafted in one go, with their draft probabilities and probability deciles."""

    tokens: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)  # [V] each, sampled drafts only
    deciles: list[int] = field(default_factory=list)
    seconds: float = 0.0  # the time its draft forwards took

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, other: Chunk) -> None:
        self.tokens += other.tokens
        self.qs += other.qs
        self.deciles += other.deciles

    def head(self, n: int) -> Chunk:
        return Chunk(self.tokens[:n], self.qs[:n], self.deciles[:n])

    def tail(self, start: int) -> Chunk:
        return Chunk(self.tokens[start:], self.qs[start:], self.deciles[start:])

    def tree(self) -> DraftTree:
        tree = DraftTree.chain(self.tokens, torch.stack(self.qs) if self.qs else None)
        tree.tags = [("dm", d) for d in self.deciles]
        return tree


class Continuation:
    """The post-verify job: the draft model drafts after ``last`` in a thread until ``stop`` is set
    (at least one token) or ``limit`` tokens are drafted."""

    def __init__(self, drafter: PearlDrafter, last: int, limit: int, until_stopped: bool):
        self.stop = threading.Event()
        self.chunk = Chunk()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(drafter, last, limit, until_stopped), daemon=True)
        self.thread.start()

    def _run(self, drafter: PearlDrafter, last: int, limit: int, until_stopped: bool) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                drafter.draft_after(last, limit, self.chunk, self.stop if until_stopped else None)
        except Exception as e:  # noqa: BLE001 (handed to the engine's thread by join())
            self.error = e

    def join(self) -> Chunk:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.chunk


class PearlDrafter(DraftModelDrafter):
    """PEARL's pre- and post-verify over a draft model with the target's tokenizer (chains only).

    Args:
        draft_model: the draft (a transformers causal LM, its own runner and cache).
        gamma: the chunk length; None (default): adaptive as in the paper, the continuation drafts
            while the target verifies and a fresh chunk is as long as the measured ratio of
            verification time to draft-token time.
        max_draft: the most tokens a chunk takes (the engine's budget may cut it further).
        post_verify: False drafts sequentially (``draft_model``'s chain with PEARL's lengths), the
            comparison of ``benchmarks/pearl_vs_sequential.py``.
        pre_verify: where no chunk is ready, propose only the first drafted token and draft the rest
            of the chunk while the target verifies it (needs ``post_verify``).
    """

    name = "pearl"

    def __init__(self, draft_model: torch.nn.Module, gamma: int | None = None, max_draft: int = 16,
                 post_verify: bool = True, pre_verify: bool = True):
        if gamma is not None and gamma < 1:
            raise SpeculumError(f"pearl's gamma is a chunk length >= 1 (or None: adaptive); got {gamma}")
        if max_draft < 1:
            raise SpeculumError(f"pearl's max_draft must be >= 1; got {max_draft}")
        super().__init__(draft_model, num_draft=max_draft, adaptive=False)
        self.gamma, self.post_verify = gamma, post_verify
        self.pre_verify = pre_verify and post_verify
        self.hits = self.misses = 0  # steps whose chunk came ready from post-verify / not (all requests)
        self.job: Continuation | None = None
        # one draft forward at a time on the draft's runner: the forks of a batch share it
        self.forward_lock = threading.Lock()

    # -- request life ------------------------------------------------------------------------------

    def reset(self, prompt_ids, params, generator):
        self._drop_job()
        super().reset(prompt_ids, params, generator)
        # the continuation samples while the verifier samples: a generator of its own
        self.draft_generator = None
        if generator is not None:
            self.draft_generator = torch.Generator(device=generator.device)
            self.draft_generator.manual_seed(int(torch.randint(0, 1 << 62, (), generator=generator)))
        self.expected: list[int] | None = None  # tokens[len(old):] that make the continuation valid
        self.verify_s = self.token_s = None  # running means: one verification, one draft forward
        self.proposed_at = 0.0

    def finish(self, tokens: list[int]) -> None:
        self._drop_job()
        super().finish(tokens)

    def fork(self) -> PearlDrafter:
        other = super().fork()
        other.job = None
        return other

    def _drop_job(self) -> None:
        job, self.job = getattr(self, "job", None), None
        if job is not None:
            job.join()

    # -- drafting ----------------------------------------------------------------------------------

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        chunk = self._ready_chunk(tokens)  # the draft cache holds tokens + chunk[:-1] (tokens[:-1] if empty)
        want = max(min(self._chunk_length(), budget), 0)
        if self.pre_verify and not chunk.tokens:  # nothing ready: the first token alone, the rest beside its check
            want = min(want, 1)
        if len(chunk) > want:
            chunk = chunk.head(want)
            self.cache.rollback(len(tokens) - 1 + want)
            del self.seen[len(tokens) - 1 + want:]
        elif len(chunk) < want and not (chunk.tokens and chunk.tokens[-1] in self.end_ids):
            with torch.inference_mode():
                fresh = Chunk()
                self.draft_after(chunk.tokens[-1] if chunk.tokens else tokens[-1], want - len(chunk), fresh)
            chunk.extend(fresh)
            self._time_tokens(fresh)
        if not chunk.tokens:
            self.expected = None
            return DraftTree()
        last = chunk.tokens[-1]
        if self.post_verify and last not in self.end_ids:
            self.expected = chunk.tokens[:]  # + the continuation's first token, checked next step
            # its first token is checked against the bonus token, the rest is the next chunk
            limit = 1 + (self.max_draft if self.gamma is None else min(self.gamma, self.max_draft))
            self.job = Continuation(self, last, limit, until_stopped=self.gamma is None)
        else:
            self.expected = None
        self.proposed_at = time.perf_counter()
        return chunk.tree()

    def _ready_chunk(self, tokens: list[int]) -> Chunk:
        """The post-verify continuation's tokens after its first, if the last chunk was accepted
        whole and the target's bonus token is that first token (a *hit*); else an empty chunk,
        the draft cache synced to ``tokens``."""
        job, self.job = self.job, None
        if job is not None:
            cont = job.join()
            self._time_tokens(cont)
            old = len(tokens) - len(self.expected) - 1
            if cont.tokens and tokens[old:] == self.expected + cont.tokens[:1]:
                self.hits += 1
                return cont.tail(1)
            self.misses += 1
        with self.forward_lock:
            self._sync(tokens)
        return Chunk()

    def draft_after(self, last: int, limit: int, out: Chunk, stop: threading.Event | None = None) -> None:
        """Draft up to ``limit`` tokens after ``last`` into ``out`` (whose KV entries, all but the
        last token's, are committed to the draft cache); stop early at an EOS or once ``stop`` is
        set (after the first token)."""
        t = time.perf_counter()
        for _ in range(limit):
            if stop is not None and out.tokens and stop.is_set():
                break
            with self.forward_lock:
                logits = self.runner.forward_tree(self.cache, last, DraftTree())[-1]  # [V]
                self.cache.commit()
            self.seen.append(last)
            if self.params.greedy:
                probs = torch.softmax(logits.float(), -1)
                last = int(probs.max(-1).indices)
            else:
                probs = self.params.probs(logits)
                last = self.pick(probs)
                out.qs.append(probs)
            out.tokens.append(last)
            out.deciles.append(min(int(float(probs[last]) * 10), 9))
            if last in self.end_ids:
                break
        out.seconds = time.perf_counter() - t

    def pick(self, probs: torch.Tensor) -> int:
        """A sampled draft token from ``probs [V]`` (the draft's q)."""
        return int(torch.multinomial(probs, 1, generator=self.draft_generator))

    # -- lengths -----------------------------------------------------------------------------------

    def _chunk_length(self) -> int:
        """``gamma``, or the measured ratio of verification time to draft-token time (the paper's
        window; the first chunk of a request: ``max_draft``'s quarter, at least one)."""
        if self.gamma is not None:
            return min(self.gamma, self.max_draft)
        if self.verify_s is None or not self.token_s:
            return max(1, self.max_draft // 4)
        return max(1, min(self.max_draft, round(self.verify_s / self.token_s)))

    def _time_tokens(self, chunk: Chunk) -> None:
        if chunk.tokens and chunk.seconds > 0:
            self.token_s = _mean(self.token_s, chunk.seconds / len(chunk))

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if self.job is not None:
            self.job.stop.set()  # verification is over: the continuation has had its time
        if len(tree):
            self.verify_s = _mean(self.verify_s, time.perf_counter() - self.proposed_at)
        super().update(tokens, tree, acceptance, logits)


def _mean(old: float | None, new: float, weight: float = 0.3) -> float:
    """An exponential running mean (``new``'s weight ``weight``)."""
    return new if old is None else (1 - weight) * old + weight * new
