"""Train judge decoding's linear judge (:mod:`speculum.verify.judge`) with a cheap proxy label.

Data: the target samples continuations of the prompts itself (temperature 1, so that tokens
other than its argmax appear); one verification forward over each continuation gives, for every
token ``x_t``, the target's distribution ``p_t`` before it and the hidden state ``h_t`` of the
chosen layer with ``x_t`` as input (the row judge decoding reads for a drafted token).

Label (the proxy, not the paper's human labels): ``x_t`` is acceptable when
``p_t(x_t) >= ratio * max p_t``, i.e. when the target nearly chose it itself. Argmax tokens are
acceptable by that label too, so the judge also learns what greedy verification accepts anyway.

Fit: logistic regression of the label on ``h_t`` (class-balanced, full-batch Adam, weight decay).

Example::

    head = train_judge(runner, [tok.encode("Tell me a story")], new_tokens=64)
    head.save("judge.pt")   # speculum generate --judge judge.pt ...  (LOSSY)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree
from ..verify.judge import JudgeHead


@torch.inference_mode()
def judge_examples(runner, prompts: Sequence[list[int]], new_tokens: int = 64, ratio: float = 0.5,
                   layer: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [N, D], labels [N] bool)`` over the target's own sampled continuations of ``prompts``."""
    layer = runner.num_layers if layer is None else layer
    gen = torch.Generator().manual_seed(seed)
    sample = SamplingParams(temperature=1.0)
    xs, ys = [], []
    for prompt in prompts:
        tokens = _sampled(runner, prompt, new_tokens, sample, gen)
        cache = runner.new_cache(len(prompt) + new_tokens + 2)
        runner.prefill(cache, prompt[:-1])
        out = runner.forward(cache, prompt[-1], DraftTree.chain(tokens), [layer])
        probs = torch.softmax(out.logits[:-1].float(), -1)  # [n, V]: row t predicts tokens[t]
        chosen = probs.gather(1, torch.tensor(tokens, device=probs.device)[:, None])[:, 0]  # [n]
        ys.append((chosen >= ratio * probs.max(-1).values).cpu())
        xs.append(out.hidden[layer][1:].float().cpu())  # [n, D]: row t has tokens[t] as input
    return torch.cat(xs), torch.cat(ys)


def _sampled(runner, prompt: list[int], n: int, params: SamplingParams, gen: torch.Generator) -> list[int]:
    """``n`` tokens the target samples after ``prompt`` (one forward per token)."""
    cache = runner.new_cache(len(prompt) + n + 2)
    runner.prefill(cache, prompt[:-1])
    last, out = prompt[-1], []
    for _ in range(n):
        logits = runner.forward(cache, last, DraftTree()).logits[-1]  # [V]
        runner.commit(cache, [0])
        last = int(torch.multinomial(params.probs(logits).cpu(), 1, generator=gen))
        out.append(last)
    return out


def fit_judge(hidden: torch.Tensor, labels: torch.Tensor, layer: int, steps: int = 300, lr: float = 0.05,
              weight_decay: float = 1e-3, threshold: float = 0.5, ratio: float = 0.5, model: str = "") -> JudgeHead:
    """Logistic regression of ``labels`` ``[N]`` on ``hidden`` ``[N, D]`` (features standardized
    while fitting, folded back into the head), each class weighted by the other's frequency."""
    x, y = hidden.float(), labels.float()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    pos = y.mean().clamp(0.01, 0.99)
    weights = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))  # [N] class balance
    opt = torch.optim.Adam([w, b], lr=lr, weight_decay=weight_decay)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, weight=weights)
            loss.backward()
            opt.step()
    weight = (w / std).detach()
    bias = float((b - (mean / std) @ w).detach())
    return JudgeHead(weight, bias, layer, threshold, ratio, model)


def train_judge(runner, prompts: Sequence[list[int]], new_tokens: int = 64, ratio: float = 0.5,
                layer: int | None = None, seed: int = 0, **fit) -> JudgeHead:
    """A judge head for ``runner``'s model from its own continuations of ``prompts`` (see the module)."""
    layer = runner.num_layers if layer is None else layer
    hidden, labels = judge_examples(runner, prompts, new_tokens, ratio, layer, seed)
    return fit_judge(hidden, labels, layer, ratio=ratio, **fit)
