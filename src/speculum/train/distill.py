"""Self-distillation data: the target model answers the training prompts, and the hidden states it
computed on the way are kept as the heads' features.

Generation runs many requests at once through the engine (:func:`speculum.engine.step` over a slot
pool: one forward for every running request). A recording drafter drafts nothing and keeps the
hidden states the engine hands it (:meth:`~speculum.drafters.base.Drafter.see_hidden`): the prompt's
from prefill, then one row per generated token as it is verified. So a sample of ``T`` tokens
(prompt + response) comes with features for its first ``T - 1`` tokens, without a second pass.

A share of the responses is sampled (temperature 0.8, top-p 0.95, seeded per prompt) so that the
heads also see the text a sampled request produces; the rest is greedy.

Samples are written in shards (``data/shard-NNNNN.pt``) as they finish, each with its prompt's
index, so an interrupted run resumes where it stopped; the batch never drains between shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..drafters.base import Drafter
from ..engine import Engine, step
from ..prompts import encode_prompt
from ..sampling import SamplingParams
from ..tree import DraftTree

SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)


@dataclass
class Sample:
    """One self-distilled sequence."""

    ids: list[int]  # [T] prompt + response token ids
    prompt_len: int
    kind: str
    feats: torch.Tensor  # [F, D] the target's features (final norm) of ids[:F], F <= T - 1 (a last step reports none)
    index: int = -1  # the prompt's index in the prompt set
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [F, D], intermediate hidden states


def record_layers(num_layers: int) -> tuple[int, ...]:
    """The hidden states the data keeps, numbered as :mod:`speculum.runners.base` (``num_layers``: the
    final norm's output, every head's feature): also layers 2 and 4 (an early exit's, Kangaroo) and
    ``L // 2`` and ``L - 3`` (the low, middle and high features EAGLE-3 fuses)."""
    return tuple(sorted({i for i in (2, 4, num_layers // 2, num_layers - 3) if 0 < i < num_layers} | {num_layers}))


class RecordingDrafter(Drafter):
    """Drafts nothing; keeps the hidden states of ``layers`` of every cached token."""

    name = "record"

    def __init__(self, layers: Sequence[int]):
        self.hidden_layers = tuple(layers)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.rows: dict[int, list[torch.Tensor]] = {i: [] for i in self.hidden_layers}

    def see_hidden(self, hidden):
        for i in self.hidden_layers:
            self.rows[i].append(hidden[i])

    def recorded(self) -> dict[int, torch.Tensor]:
        """``{layer: [F, D]}`` of every token cached so far."""
        return {i: torch.cat(rows) for i, rows in self.rows.items()}

    def propose(self, tokens, budget):
        return DraftTree()


def generate_batched(runner, tokenizer, prompts: Sequence[list[int]], max_new_tokens: int, layers: Sequence[int],
                     sampled: Sequence[bool] = (), batch: int = 16, seed: int = 0,
                     on_done: Callable[[int, list[int], torch.Tensor], None] | None = None,
                     seeds: Sequence[int] = ()) -> None:
    """Answer every prompt (token ids), ``batch`` at a time in one forward per step; for each,
    ``on_done(index, response ids, {layer: hidden states [F, D]})`` (of the first ``F < T`` tokens) as it
    finishes (in any order).
    A sampled prompt ``i`` draws with seed ``seeds[i]`` (default ``seed + i``)."""
    engine = Engine(runner, RecordingDrafter(layers), tokenizer, max_tree=1)
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2
    pool = runner.new_pool(min(batch, len(prompts)), capacity)
    queue = list(range(len(prompts)))[::-1]
    running: list[tuple[int, object]] = []
    while queue or running:
        while queue and len(running) < batch:
            i = queue.pop()
            params = SAMPLED if (sampled and sampled[i]) else SamplingParams()
            d = engine.start(prompts[i], max_new_tokens, params, seed=seeds[i] if seeds else seed + i,
                             cache=pool.acquire(),
                             drafter=RecordingDrafter(layers))
            running.append((i, d))
        step([d for _, d in running])
        left = []
        for i, d in running:
            if d.reason is None:
                left.append((i, d))
                continue
            pool.release(d.cache)
            if on_done is not None:
                on_done(i, d.tokens[len(prompts[i]):], d.drafter.recorded())
        running = left


def self_distill(model, tokenizer, prompts: Sequence[tuple[str, str]], out: Path, max_new_tokens: int = 256,
                 sampled_share: float = 0.25, batch: int = 16, max_prompt: int = 768, shard: int = 64,
                 seed: int = 0, progress: bool = True, layers: Sequence[int] | None = None) -> list[Path]:
    """Answer ``prompts`` (``(kind, text)``) with ``model`` and write :class:`Sample` shards of
    ``shard`` samples to ``out`` as they finish; returns every shard's path. Prompts answered in the
    shards already there are skipped (resuming); which prompts are sampled, and their seeds, depend
    on the prompt's index only. ``layers``: the hidden states kept (default :func:`record_layers`);
    the last is every head's feature (:attr:`Sample.feats`), the others :attr:`Sample.layers`."""
    from tqdm import tqdm

    from ..runners import runner_for

    runner = runner_for(model)
    layers = record_layers(runner.num_layers) if layers is None else tuple(layers)
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(out.glob("shard-*.pt"))
    encoded = [(i, kind, encode_prompt(tokenizer, text)) for i, (kind, text) in enumerate(prompts)]
    fits = [i for i, _, ids in encoded if len(ids) <= max_prompt]
    # shards of the first version carry no index: they hold the fitting prompts in order
    done_before = {d.get("index", fits[pos] if pos < len(fits) else -1)
                   for pos, d in enumerate(d for p in shards for d in torch.load(p, weights_only=False))}
    todo = [(i, k, ids) for i, k, ids in encoded if len(ids) <= max_prompt and i not in done_before]
    every = max(1, round(1 / sampled_share)) if sampled_share > 0 else 0
    bar = tqdm(total=len(todo) + len(done_before), initial=len(done_before), desc="self-distilling",
               unit="prompt", disable=not progress)
    pending: list[Sample] = []

    def flush() -> None:
        path = out / f"shard-{len(shards):05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save([x.__dict__ for x in pending], tmp)
        tmp.replace(path)
        shards.append(path)
        pending.clear()

    def done(j, response, hidden):
        i, kind, ids = todo[j]
        kept = {k: h.to(torch.bfloat16).clone() for k, h in hidden.items()}
        pending.append(Sample(ids + response, len(ids), kind, kept.pop(layers[-1]), i, kept))
        bar.update(1)
        if len(pending) >= shard:
            flush()

    if todo:
        sampled = [bool(every) and i % every == 0 for i, _, _ in todo]
        generate_batched(runner, tokenizer, [ids for _, _, ids in todo], max_new_tokens, layers, sampled, batch,
                         seed, done, seeds=[seed + i for i, _, _ in todo])
    if pending:
        flush()
    bar.close()
    return shards


def load_samples(paths: Sequence[Path]) -> list[Sample]:
    return [Sample(**d) for p in paths for d in torch.load(p, weights_only=False)]
