"""What a generation returns: the tokens and text, why it ended, and per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a generation ended (a string too: it compares equal to, and serializes as, its value)."""

    EOS = "eos"  # an end-of-sequence token
    LENGTH = "length"  # the requested number of new tokens
    STOP = "stop"  # a stop string (cut from the text)
    CONTEXT = "context"  # the model's context is full
    CLOSED = "closed"  # the budget closer ended a grammar-constrained output validly
    CANCELLED = "cancelled"  # the caller stopped it
    ERROR = "error"  # the batch it ran in failed


@dataclass
class StepStats:
    """One target forward: how many tokens were drafted and accepted, and where the time went."""

    drafted: int
    accepted: int  # drafted tokens accepted (the bonus token is not counted)
    committed: int  # tokens added to the output by this step (accepted + bonus, after stop truncation)
    draft_s: float
    verify_s: float
    other_s: float
    forced: int = 0  # drafted tokens the grammar forced (jump-forward), included in ``drafted``
    mask_s: float = 0.0  # grammar work: pruning the tree and computing the masks (in draft_s)


@dataclass
class TokenLogprob:
    """One emitted token's log-probability and the most likely alternatives at its position.

    ``logprob`` is None for a token without a computed distribution: one a grammar's budget closer
    appended after the verified ones (:class:`~speculum.constrain.Grammar`'s ``close_reserve``)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), most likely first


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]  # generated token ids (an EOS that ended generation included)
    text: str  # generated text, stop string excluded
    finish_reason: FinishReason
    time_s: float  # prefill + decode wall time
    prefill_s: float
    forwards: int  # target forward passes that produced tokens (engine: one per step)
    steps: list[StepStats] = field(default_factory=list)  # per-step detail (engine methods only)
    kv_bytes: int = 0  # the most bytes the KV cache held (committed entries; 0 where not measured)
    logprobs: list[TokenLogprob] | None = None  # one per token, where the sampling parameters asked
    verify: str = "specinfer"  # the verification rule (speculum.verify.rules; engine methods)
    lossy: bool = False  # True when a lossy rule (judge decoding) may have committed other text than plain decoding

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "new_tokens": self.new_tokens,
            "time_s": round(self.time_s, 4),
            "tok_s": round(self.tok_s, 3),
            "mean_accepted": round(self.mean_accepted, 4),
            "steps": self.forwards,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "drafted": sum(s.drafted for s in self.steps),
            "accepted": sum(s.accepted for s in self.steps),
            "time_draft_s": round(sum(s.draft_s for s in self.steps), 4),
            "time_verify_s": round(sum(s.verify_s for s in self.steps), 4),
            "time_other_s": round(sum(s.other_s for s in self.steps), 4),
            "forced": sum(s.forced for s in self.steps),
            "time_mask_s": round(sum(s.mask_s for s in self.steps), 4),
            "kv_bytes": self.kv_bytes,
            "verify": self.verify,
            **({"lossy": True} if self.lossy else {}),
            **({} if self.logprobs is None else {"logprobs": [
                {"token": t.token, "logprob": t.logprob, "top": [list(x) for x in t.top]} for t in self.logprobs]}),
        }
