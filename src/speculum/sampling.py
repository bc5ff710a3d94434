"""Sampling parameters: the one object that turns target logits into the distribution p.

Plain decoding and speculative verification both call :meth:`SamplingParams.probs`, so a
speculative method samples from exactly the same p as plain sampling does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SpeculumError

MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound)
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1`` disable those filters.

    ``repetition_penalty`` (1: off; transformers' and vLLM's, over the prompt and the output),
    ``frequency_penalty`` and ``presence_penalty`` (0: off; OpenAI's, over the output, each in
    [-2, 2]) change the logits before all of that, position by position
    (:mod:`speculum.penalties`).

    ``logprobs``: also return each emitted token's log-probability and the ``logprobs`` most likely
    alternatives at its position (None: off; at most :data:`MAX_LOGPROBS`), from the distribution
    ``logprobs_mode`` names: ``"raw"``, the model's own (log-softmax of its logits), or
    ``"processed"``, the one the token was chosen from (after penalties and grammar masking, and
    when sampling after temperature, top-k and top-p). They come from the verification forward that
    accepted the token, so they cost no forward of their own."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) \
                or self.temperature < 0:
            raise SpeculumError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpeculumError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpeculumError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)) \
                or self.repetition_penalty <= 0:
            raise SpeculumError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise SpeculumError(f"{name} must be a number in [-2, 2], got {value}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SpeculumError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise SpeculumError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> ``[..., V]`` float32 log-probabilities of ``logprobs_mode``'s
        distribution (``logits`` already penalized and masked for ``"processed"``)."""
        if self.logprobs_mode == "processed" and not self.greedy:
            return self.probs(logits).log()
        return torch.log_softmax(logits.float(), dim=-1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> ``[..., V]`` float32 probabilities after temperature, top-k and top-p.

        Greedy parameters give a one-hot on the argmax.
        """
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already reach top_p
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, -math.inf)
        return logits.softmax(-1)
