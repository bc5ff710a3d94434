"""speculum: lossless speculative decoding for Hugging Face causal language models.

Quick start::

    import speculum
    model, tokenizer = speculum.load("default")          # SmolLM2-135M-Instruct, bfloat16
    out = speculum.generate(model, tokenizer, "Summarize: ...", method="auto", max_new_tokens=128)
    print(out.text, out.tok_s, out.mean_accepted)
"""

from __future__ import annotations

from .constrain import ConstraintSpec
from .engine import Engine, GenerationResult
from .errors import SpeculumError
from .loading import load
from .methods import METHODS, build_method
from .prompts import encode_prompt
from .sampling import SamplingParams
from .tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "ConstraintSpec",
    "DraftTree",
    "Engine",
    "GenerationResult",
    "SamplingParams",
    "SpeculumError",
    "build_method",
    "encode_prompt",
    "generate",
    "load",
]


def generate(model, tokenizer, prompt: str, method: str = "auto", max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             stop=(), chat: bool | None = None, draft_model=None, draft_tokenizer=None,
             constraint: ConstraintSpec | None = None, close_reserve: int = 0, repetition_penalty: float = 1.0,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logprobs: int | None = None,
             logprobs_mode: str = "raw", **options) -> GenerationResult:
    """Generate a completion of ``prompt`` with ``method`` (see :data:`METHODS`).

    ``chat=None`` applies the tokenizer's chat template when it has one. Each call builds a fresh
    drafter; for a stream of requests build the method once with :func:`build_method` and call
    its ``run``, so that drafters that learn across requests (``suffix``, ``recycling``,
    ``auto``) keep what they learnt. ``constraint`` (e.g. ``ConstraintSpec.json_schema(schema)``)
    restricts the output to a JSON schema, a regex, fixed choices or a Lark grammar;
    ``close_reserve`` turns on its budget closer (:class:`~speculum.constrain.Grammar`). The
    penalties are :class:`SamplingParams`' (off by default), and so are ``logprobs`` (each token's
    log-probability and that many alternatives, in the result's ``logprobs``) and ``logprobs_mode``.
    """
    params = SamplingParams(temperature, top_k, top_p, repetition_penalty, frequency_penalty, presence_penalty,
                            logprobs, logprobs_mode)
    runner = build_method(method, model, tokenizer, draft_model, draft_tokenizer, **options)
    ids = encode_prompt(tokenizer, prompt, chat)
    grammar = runner.compile(constraint, close_reserve) if constraint is not None else None
    return runner.run(ids, max_new_tokens, params, stop, seed, grammar=grammar)
