"""``medusa_online`` / ``hydra_online``: a learned head that keeps learning from the target while serving.

Online Speculative Decoding (Liu et al. 2023, "Online Speculative Decoding",
https://arxiv.org/abs/2310.07177) updates the draft from the target's outputs on the tokens it
verified: the target's distributions come free with verification, so the draft is distilled on the
traffic it serves (DistillSpec, Zhou et al. 2023, https://arxiv.org/abs/2310.08461, studies that
distillation's loss). The rule: keep a buffer of the positions where the draft was wrong, each with
the target's distribution there; every ``every`` steps, take one step that moves the draft's
distributions towards the target's (forward KL); verification is unchanged, so the output is
exactly the target's whatever the draft learns.

Here the draft is a Medusa or Hydra head (:mod:`speculum.drafters.medusa`,
:mod:`speculum.drafters.hydra`): a few ``D x D`` layers on the target's last feature, cheap to
update on a CPU. :class:`OnlineAdaptDrafter` wraps the head's drafter and:

- records, for every position ``j`` the request commits, the target's feature ``f_j [D]`` (from
  :meth:`see_hidden`) and the target's top-``r`` distribution over each token ``x_{j+2}`` .. from
  the logits row that verified it (from :meth:`update`); once ``x_{j+1+K}`` is committed, the
  position goes to the shared :class:`~speculum.drafters.online_updates.ReplayBuffer`;
- every ``every`` steps draws ``batch`` positions and takes one step on a float32 master copy of
  the head (``update="backprop"``: Adam on the loss's gradient; ``update="zo"``: a forward-only
  SPSA / MeZO step), then copies it into the drafting head. The loss counts only the labels the
  head currently gets wrong (``misses_only``, the paper's buffer of mistakes).

Worked example (one head, ``K = 1``): the prompt ends ``... the cat``; head 1 reads the feature of
``the`` and drafts ``x_{t+2}`` below the root ``cat``: it says ``dog``; the target verifies and
commits ``sat`` (its row for the root's successor gave ``sat`` 0.7, ``on`` 0.2). The buffer gets
(``f(the)``, target distribution {sat: 0.7, on: 0.2} renormalised); after ``every`` steps the head
is moved towards it, and next time it reads a feature like ``f(the)`` it is likelier to draft ``sat``.

State: the head, its master copy, the optimiser and the buffer belong to the drafter and are
shared by its :meth:`fork` s (every request of a server teaches one head); a request's pending
positions are its own. Memory is bounded by ``buffer`` positions (about ``D + 2 K r`` numbers each) and
an update's time by ``batch`` positions (``B x K`` rows through the trimmed LM head, twice).

Departures from the paper: the paper distils a whole draft model and updates it when its buffer
fills (then empties it); here the head updates every ``every`` steps from a rolling buffer, so a
server's head follows its recent traffic at a bounded cost per step; each distribution is kept as
its top ``r = 8`` tokens rather than whole (``[V]`` per position would make the buffer hundreds of
megabytes). The default rule is backprop (the paper's); ``zo`` is speculum's forward-only
alternative for a CPU.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SpeculumError
from ..heads import LEARNED, TargetTables
from ..tree import DraftTree
from .base import Drafter
from .online_updates import (
    Batch,
    ReplayBuffer,
    backprop_step,
    distill_loss,
    head_logits,
    misses,
    zeroth_order_step,
)

UPDATES = ("backprop", "zo")
KINDS = ("medusa", "hydra")


@dataclass
class OnlineStats:
    """What the shared head has learned so far: updates taken, their losses and seconds."""

    updates: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # the loss before each update (the latest 64)


class SharedHead:
    """The state every fork shares: the drafting head, its float32 master copy, the optimiser,
    the buffer, the step count."""

    def __init__(self, drafting: torch.nn.Module, tables: TargetTables, vocab_size: int, update: str,
                 buffer: int, lr: float, eps: float, seed: int):
        self.drafting = drafting
        self.master = type(drafting)(drafting.config).float()
        self.master.load_state_dict({k: v.float() for k, v in drafting.state_dict().items()})
        self.params = list(self.master.parameters())
        self.tables = tables  # float32, the draft vocabulary's rows: gradients flow through them
        self.columns = torch.full((vocab_size,), -1, dtype=torch.int64)  # [V] token id -> draft column
        if tables.vocab is None:
            self.columns = torch.arange(vocab_size)
        else:
            self.columns[tables.vocab.long()] = torch.arange(tables.vocab.numel())
        self.update, self.lr, self.eps, self.seed = update, lr, eps, seed
        self.optimizer = torch.optim.Adam(self.params, lr=lr) if update == "backprop" else None
        self.buffer = ReplayBuffer(buffer, seed)
        self.steps = 0
        self.stats = OnlineStats()

    def objective(self, batch: Batch, misses_only: bool):
        """The loss on ``batch`` of the master head's weights as they stand, over the labels it gets
        wrong now (``misses_only``) or all the target's."""
        with torch.no_grad():
            rows = misses(head_logits(self.master, self.tables, batch), batch) if misses_only else batch.mask
        return lambda: distill_loss(head_logits(self.master, self.tables, batch), batch, rows)

    def learn(self, batch: Batch, misses_only: bool) -> float:
        """One update of the master head on ``batch``, copied into the drafting head; the loss before."""
        t = time.perf_counter()
        objective = self.objective(batch, misses_only)
        if self.update == "backprop":
            loss = backprop_step(objective, self.optimizer)
        else:
            loss = zeroth_order_step(objective, self.params, self.lr, self.eps, self.seed + self.stats.updates)
        with torch.no_grad():
            for mine, master in zip(self.drafting.parameters(), self.master.parameters(), strict=True):
                mine.copy_(master)
        self.drafting.freeze()  # the drafting copies of the weights (prepacked products) again
        self.stats.updates += 1
        self.stats.seconds += time.perf_counter() - t
        self.stats.losses = [*self.stats.losses[-63:], loss]
        return loss


class OnlineAdaptDrafter(Drafter):
    """A Medusa or Hydra head drafter whose head learns from verification (see the module docstring).

    Args:
        target / draft_head: as for the head's drafter (default the head shipped for ``target``).
        kind: ``"medusa"`` or ``"hydra"``.
        update: ``"backprop"`` (Adam on the gradient) or ``"zo"`` (SPSA / MeZO, forward passes only).
        every: steps (of all forks together) between updates.
        buffer: positions kept; batch: positions per update.
        lr: the step size (Adam's for backprop; MeZO's for zo); eps: zo's perturbation.
        top_r: the target's top tokens kept per distribution (1: its argmax, a hard label).
        misses_only: learn only from the labels the head gets wrong (the paper's buffer of mistakes).
        seed: the buffer's draws and zo's noise.
        head_options: the head drafter's (``top_k``, ``max_nodes``, ...).
    """

    def __init__(self, target: torch.nn.Module, draft_head: str | Path | None = None, kind: str = "medusa",
                 update: str = "backprop", every: int = 8, buffer: int = 512, batch: int = 64,
                 lr: float | None = None, eps: float = 1e-3, top_r: int = 8, misses_only: bool = True,
                 seed: int = 0, **head_options):
        if kind not in KINDS:
            raise SpeculumError(f"online adaptation learns a head of kind {' or '.join(KINDS)}, not {kind!r}")
        if update not in UPDATES:
            raise SpeculumError(f"online adaptation's update is {' or '.join(UPDATES)}, not {update!r}")
        if min(every, buffer, batch, top_r) < 1:
            raise SpeculumError("online adaptation's every, buffer, batch and top_r must be at least 1")
        self.inner = LEARNED[kind].drafter_class()(target, draft_head, **head_options)
        if self.inner.head.config.vocab:
            raise SpeculumError(f"online adaptation learns heads that share the target's LM head; {self.inner.path} "
                                "has LM heads of its own (a published head)")
        self.name = f"{kind}_online"
        self.hidden_layers = self.inner.hidden_layers
        self.depth = self.inner.depth
        self.every, self.batch, self.top_r, self.misses_only = every, batch, top_r, misses_only
        # the drafter's own copy of the head: the loaded one is shared by every method of the target
        drafting = type(self.inner.head)(self.inner.head.config)
        drafting.load_state_dict(self.inner.head.state_dict())
        self.inner.head = drafting.to(self.inner.tables.embed.dtype).eval().requires_grad_(False).freeze()
        tables = TargetTables.of(target, self.inner.tables.vocab, torch.float32)
        lr = lr if lr is not None else (1e-3 if update == "backprop" else 1e-5)
        self.shared = SharedHead(self.inner.head, tables, self.inner.vocab_size, update, buffer, lr, eps, seed)

    @property
    def stats(self) -> OnlineStats:
        return self.shared.stats

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.inner.end_ids = self.end_ids
        self.inner.reset(prompt_ids, params, generator)
        self.prompt_len = len(prompt_ids)
        self.seen = 0  # positions whose features came
        self.feats: dict[int, torch.Tensor] = {}  # position j -> f_j [D], waiting for its labels
        self.dists: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position p -> top-r (ids [r], probs [r]) over x_p

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        return self.inner.propose(tokens, budget)

    def see_batch(self, sequences: int) -> None:
        self.inner.see_batch(sequences)

    def see_hidden(self, hidden: dict[int, torch.Tensor]) -> None:
        self.inner.see_hidden(hidden)
        rows = hidden[self.hidden_layers[0]]
        first = self.prompt_len - 2  # the first position whose head-1 label the target generates
        for i, row in enumerate(rows):
            if self.seen + i >= first:
                self.feats[self.seen + i] = row.detach().float()
        self.seen += rows.shape[0]

    @torch.no_grad()
    def update(self, tokens, tree, acceptance, logits):
        self.inner.update(tokens, tree, acceptance, logits)
        kept = [0] + [i + 1 for i in acceptance.path]  # the rows that verified the committed tokens
        start = len(tokens) - len(acceptance.tokens)
        if tokens[start:] == acceptance.tokens:  # (a constraint that forced other tokens: hard labels only)
            top = torch.log_softmax(logits[kept].float(), -1).topk(min(self.top_r, logits.shape[-1]), -1)
            for i in range(len(kept)):
                self.dists[start + i] = (top.indices[i], top.values[i].exp())
        self._harvest(tokens)
        shared = self.shared
        shared.steps += 1
        if shared.steps % self.every == 0 and len(shared.buffer):
            # (the server's scheduler steps in inference mode: tensors made there cannot be learned from)
            with torch.inference_mode(False), torch.enable_grad():
                shared.learn(shared.buffer.sample(self.batch), self.misses_only)

    def _harvest(self, tokens: list[int]) -> None:
        """Move the positions whose labels ``x_{j+1} .. x_{j+1+K}`` are all committed to the buffer."""
        k, columns = self.depth, self.shared.columns
        for j in sorted(p for p in self.feats if p + 1 + k < len(tokens)):
            label_pos = range(j + 2, j + 2 + k)
            cols, probs = zip(*(self._label(tokens, p) for p in label_pos), strict=True)
            self.shared.buffer.add(self.feats.pop(j), torch.tensor(tokens[j + 1:j + 2 + k]),
                                   columns[torch.stack(cols)], torch.stack(probs),
                                   torch.tensor([p >= self.prompt_len for p in label_pos]))
        for p in [p for p in self.dists if p < min(self.feats, default=len(tokens)) + 2]:
            del self.dists[p]

    def _label(self, tokens: list[int], p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-r ``(ids [r], probs [r])`` over ``x_p``; the committed token alone where
        verification gave none (a prompt token, a forced one)."""
        if p in self.dists:
            return self.dists[p]
        ids = torch.full((self.top_r,), tokens[p], dtype=torch.int64)
        probs = torch.zeros(self.top_r)
        probs[0] = 1.0
        return ids, probs

    def fork(self) -> OnlineAdaptDrafter:
        other = copy.copy(self)
        other.inner = self.inner.fork()
        other.feats, other.dists = {}, {}  # its request's own
        return other

    def finish(self, tokens: list[int]) -> None:
        self.inner.finish(tokens)
        if getattr(self, "feats", None):  # (a request that started)
            self._harvest(tokens)  # the last step's labels: committed tokens (no update call gave their rows)
        self.feats, self.dists = {}, {}
