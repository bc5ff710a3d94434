"""Training PPD's prompt tokens (:mod:`speculum.heads.ppd`) on self-distilled samples
(:mod:`speculum.train.distill`), through the frozen target.

The reference implementation appends the prompt tokens once, at the end of a randomly cut
sequence. Here one forward serves many cuts: a sample's ``T`` real tokens (causal, as always) and,
for each of ``K`` cut points ``c`` in its response, the ``N * E`` prompt rows of a chain anchored at
token ``c - 1``: row ``(i, j)`` at position ``c + i`` sees tokens ``< c`` and, by PPD's ensemble
mask, member ``j`` of positions ``<= i`` of its own chain; real tokens never see prompt rows, so
one forward equals ``K`` of the reference's. Prompt position ``i`` is trained on the token
``x_{c+1+i}`` (cross-entropy weighted ``0.8^i``; the ensemble's logits averaged first). These
self-distilled tokens are the target's own outputs, so that is PPD's distillation objective. Only
the prompt embeddings receive gradients.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..attention import in_window
from ..heads import PPDConfig, PPDPrompts
from .distill import Sample
from .trainer import HeadTrainer

CUTS = 32  # cut points per sample and forward


class Cuts:
    """Samples (cut to ``max_len`` tokens) in batches of about ``batch_pairs`` tokens; each batch
    entry draws its cut points anew (fixed ones for held-out data)."""

    def __init__(self, samples: list[Sample], max_len: int, batch_pairs: int, rng: random.Random, depth: int,
                 fixed: bool):
        self.items = []
        for s in samples:
            ids = s.ids[:max_len]
            first, last = max(1, s.prompt_len), len(ids) - 2  # anchors in the response; x_{c+1} exists
            if last >= first:
                self.items.append((ids, first, last))
        self.batch_pairs, self.rng, self.depth, self.fixed = batch_pairs, rng, depth, fixed

    def epoch(self) -> list[list[int]]:
        order = list(range(len(self.items)))
        self.rng.shuffle(order)
        batches, cur, size = [], [], 0
        for i in order:
            n = len(self.items[i][0])
            if cur and size + n > self.batch_pairs:
                batches.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
        return batches + ([cur] if cur else [])

    def collate(self, idx: list[int]) -> list[tuple[list[int], list[int]]]:
        """``(ids, cut points)`` per sample."""
        out = []
        for i in idx:
            ids, first, last = self.items[i]
            span = list(range(first, last + 1))
            if self.fixed:
                cuts = span[::max(1, len(span) // CUTS)][:CUTS]
            else:
                cuts = sorted(random.Random(self.rng.random()).sample(span, min(CUTS, len(span))))
            out.append((ids, cuts))
        return out


class PPDTrainer(HeadTrainer):
    kind = "ppd"

    def build_head(self, model) -> PPDPrompts:
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        cfg = model.config.get_text_config()
        self.window = getattr(cfg, "sliding_window", None) if "sliding_attention" in (getattr(cfg, "layer_types", None)
                                                                                       or ()) else None
        prompts = PPDPrompts(PPDConfig.for_target(model.config, self.cfg.num_heads, self.cfg.ensemble))
        with torch.no_grad():  # start near the typical input embedding
            typical = self.tables.embeds(torch.arange(min(4096, self.width))).mean(0)
            prompts.embeddings.copy_(typical + 0.02 * torch.randn_like(prompts.embeddings) * typical.abs().mean())
        return prompts

    def make_source(self, samples: list[Sample], rng: random.Random) -> Cuts:
        return Cuts(samples, self.cfg.max_len, self.cfg.batch_pairs, rng, self.cfg.num_heads, fixed=rng is not self.rng)

    def _forward(self, ids: list[int], cuts: list[int]) -> torch.Tensor:
        """Prompt-row logits ``[K, N * E, V]`` for one sample's cut points."""
        model, head = self.model, self.head
        r = head.embeddings.shape[0]
        t, k = len(ids), len(cuts)
        dev = head.embeddings.device
        ids_t = torch.tensor([ids], device=dev)
        embeds = model.get_input_embeddings()(ids_t)[0]  # [T, D] (scaled for Gemma)
        prompt = head.embeddings.to(embeds.dtype).repeat(k, 1)  # [K * R, D]
        cut = torch.tensor(cuts, device=dev)
        offsets = torch.tensor(head.offsets(), device=dev)  # [R] i + 1
        positions = torch.cat([torch.arange(t, device=dev), (cut[:, None] - 1 + offsets[None]).flatten()])
        # visibility [T + K R, T + K R]
        total = t + k * r
        mask = torch.zeros(total, total, dtype=torch.bool, device=dev)
        mask[:t, :t] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        mask[t:, :t] = (torch.arange(t, device=dev)[None, :] < cut.repeat_interleave(r)[:, None])
        chain = torch.from_numpy(head.chain_mask()).to(dev)
        mask[t:, t:] = torch.block_diag(*([chain] * k))
        masks = {"full_attention": mask}
        if self.window is not None:
            masks["sliding_attention"] = mask & in_window(positions, positions, self.window)
        dtype = embeds.dtype
        add = {key: torch.zeros(m.shape, dtype=dtype, device=dev).masked_fill_(~m, float("-inf"))[None, None]
               for key, m in masks.items()}
        out = model(inputs_embeds=torch.cat((embeds, prompt))[None], position_ids=positions[None],
                    attention_mask=add if self.window is not None else add["full_attention"],
                    use_cache=False, logits_to_keep=k * r)
        return out.logits[0].float().view(k, r, -1)

    def losses(self, batch, train: bool) -> tuple[torch.Tensor, list[dict]]:
        n = self.cfg.num_heads
        total = torch.zeros((), device=self.device)
        hits = [0.0] * n
        count = [0] * n
        loss_sum = [0.0] * n
        for ids, cuts in batch:
            logits = torch.stack([self.head.combine(x) for x in self._forward(ids, cuts)])  # [K, N, V]
            ids_t = torch.tensor(ids + [-1] * (n + 1), device=self.device)
            labels = ids_t[torch.tensor(cuts, device=self.device)[:, None] + 1 + torch.arange(n, device=self.device)]
            for i in range(n):
                ok = labels[:, i] >= 0
                if not ok.any():
                    continue
                ce = F.cross_entropy(logits[ok, i], labels[ok, i])
                total = total + 0.8 ** i * ce * int(ok.sum())
                hits[i] += (logits[ok, i].argmax(-1) == labels[ok, i]).float().sum().item()
                count[i] += int(ok.sum())
                loss_sum[i] += ce.item() * int(ok.sum())
        scored = max(1, count[0])
        stats = [{"token": loss_sum[i] / max(1, count[i]), "acc": hits[i] / max(1, count[i]), "n": count[i]}
                 for i in range(n)]
        return total / scored, stats
