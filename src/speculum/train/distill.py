"""Self-distillation data: the target model answers the training prompts, and the hidden states it
computed on the way are kept as the heads' features.

Generation runs many requests at once through the engine (:func:`speculum.engine.step` over a slot
pool: one forward for every running request). A recording drafter drafts nothing and keeps the
hidden states the engine hands it (:meth:`~speculum.drafters.base.Drafter.see_hidden`): the prompt's
from prefill, then one row per generated token as it is verified. So a sample of ``T`` tokens
(prompt + response) comes with features for its first ``T - 1`` tokens, without a second pass.

A share of the responses is sampled (temperature 0.8, top-p 0.95, seeded per prompt) so that the
heads also see the text a sampled request produces; the rest is greedy.

Samples are written in shards (``data/shard-NNNNN.pt``) as they finish, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    feats: torch.Tensor  # [F, D] the target's features of ids[:F], F <= T - 1 (a last step reports none)


class RecordingDrafter(Drafter):
    """Drafts nothing; keeps the hidden states of layer ``layer`` of every cached token."""

    name = "record"

    def __init__(self, layer: int):
        self.hidden_layers = (layer,)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.rows: list[torch.Tensor] = []

    def see_hidden(self, hidden):
        self.rows.append(hidden[self.hidden_layers[0]])

    def propose(self, tokens, budget):
        return DraftTree()


def generate_batched(runner, tokenizer, prompts: Sequence[list[int]], max_new_tokens: int, layer: int,
                     sampled: Sequence[bool] = (), batch: int = 16, seed: int = 0,
                     on_done: Callable[[int, list[int], torch.Tensor], None] | None = None) -> None:
    """Answer every prompt (token ids), ``batch`` at a time in one forward per step; for each,
    ``on_done(index, response ids, features [F, D])`` (of the first ``F < T`` tokens) as it finishes (in any order)."""
    engine = Engine(runner, RecordingDrafter(layer), tokenizer, max_tree=1)
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2
    pool = runner.new_pool(min(batch, len(prompts)), capacity)
    queue = list(range(len(prompts)))[::-1]
    running: list[tuple[int, object]] = []
    while queue or running:
        while queue and len(running) < batch:
            i = queue.pop()
            params = SAMPLED if (sampled and sampled[i]) else SamplingParams()
            d = engine.start(prompts[i], max_new_tokens, params, seed=seed + i, cache=pool.acquire(),
                             drafter=RecordingDrafter(layer))
            running.append((i, d))
        step([d for _, d in running])
        left = []
        for i, d in running:
            if d.reason is None:
                left.append((i, d))
                continue
            feats = torch.cat(d.drafter.rows)
            ids = d.tokens
            pool.release(d.cache)
            if on_done is not None:
                on_done(i, ids[len(prompts[i]):], feats)
        running = left


def self_distill(model, tokenizer, prompts: Sequence[tuple[str, str]], out: Path, max_new_tokens: int = 256,
                 sampled_share: float = 0.25, batch: int = 16, max_prompt: int = 768, shard: int = 64,
                 seed: int = 0, progress: bool = True, layer: int | None = None) -> list[Path]:
    """Answer ``prompts`` (``(kind, text)``) with ``model`` and write :class:`Sample` shards to
    ``out``; returns every shard's path (shards already there are kept: resuming)."""
    from tqdm import tqdm

    from ..runners import runner_for

    runner = runner_for(model)
    layer = runner.num_layers if layer is None else layer
    out.mkdir(parents=True, exist_ok=True)
    encoded = [(kind, encode_prompt(tokenizer, text)) for kind, text in prompts]
    encoded = [(k, ids) for k, ids in encoded if len(ids) <= max_prompt]
    shards = sorted(out.glob("shard-*.pt"))
    start = len(shards) * shard
    bar = tqdm(total=len(encoded), initial=min(start, len(encoded)), desc="self-distilling", unit="prompt",
               disable=not progress)
    for lo in range(start, len(encoded), shard):
        part = encoded[lo:lo + shard]
        samples: list[Sample | None] = [None] * len(part)

        def done(i, response, feats, part=part, samples=samples):
            kind, ids = part[i]
            samples[i] = Sample(ids + response, len(ids), kind, feats.to(torch.bfloat16).clone())
            bar.update(1)

        # one prompt in 1/sampled_share is answered by sampling: which ones is fixed by the index
        sampled = [sampled_share > 0 and (lo + i) % max(1, round(1 / sampled_share)) == 0 for i in range(len(part))]
        generate_batched(runner, tokenizer, [ids for _, ids in part], max_new_tokens, layer, sampled, batch,
                         seed + lo, done)
        path = out / f"shard-{lo // shard:05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save([s.__dict__ for s in samples], tmp)
        tmp.replace(path)
        shards.append(path)
    bar.close()
    return shards


def load_samples(paths: Sequence[Path]) -> list[Sample]:
    return [Sample(**d) for p in paths for d in torch.load(p, weights_only=False)]
