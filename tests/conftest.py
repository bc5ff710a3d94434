"""Shared fixtures: tiny random-weight models (Llama and Gemma-3 shapes) and the packaged real models."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from speculum.drafters.base import Drafter
from speculum.heads import LEARNED, save_head
from speculum.tree import DraftTree

TINY_VOCAB = 96
_SUITE_CACHE: str | None = None


def pytest_configure(config):
    """The suite owns its cache directory: a new, empty one per run, filled by the tests themselves
    (dequantized weights, calibration curves), so that no test depends on what an earlier run left.
    Under pytest-xdist the controller makes it and its workers (which inherit the environment) share
    it; each worker runs torch on one thread, so that the workers do not compete for the cores."""
    global _SUITE_CACHE
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        return
    _SUITE_CACHE = tempfile.mkdtemp(prefix="speculum-test-cache-")
    os.environ["SPECULUM_CACHE"] = _SUITE_CACHE


def pytest_unconfigure(config):
    if _SUITE_CACHE is not None:
        shutil.rmtree(_SUITE_CACHE, ignore_errors=True)


def tiny_llama(seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 2, logit_scale: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, attn_implementation="sdpa", bos_token_id=0,
                      eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = None
    return model


def tiny_gemma3(seed: int = 0, vocab: int = TINY_VOCAB, window: int = 8):
    """Gemma-3 text model with sliding-window layers whose window (8) is far shorter than the tests' sequences."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=window,
                           layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                        "full_attention"],
                           max_position_embeddings=256, attn_implementation="sdpa", eos_token_id=None,
                           pad_token_id=None, bos_token_id=None)
    model = Gemma3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny_model(request):
    return tiny_llama() if request.param == "llama" else tiny_gemma3()


class OracleDrafter(Drafter):
    """Drafts from a known reference continuation, corrupted at random: exercises every acceptance length.

    ``shape="chain"`` drafts chains of random length in ``[1, max_len]``; ``shape="tree"`` hangs random
    sibling branches around the (possibly corrupted) reference path.
    """

    name = "oracle"

    def __init__(self, reference: list[int], vocab: int, max_len: int = 16, shape: str = "chain", seed: int = 0):
        self.reference, self.vocab, self.max_len, self.shape = reference, vocab, max_len, shape
        self.rng = random.Random(seed)

    def _truth(self, tokens: list[int], k: int) -> list[int]:
        pos = len(tokens)
        truth = list(self.reference[pos:pos + k])
        truth += [self.rng.randrange(self.vocab) for _ in range(k - len(truth))]
        if truth and self.rng.random() < 0.6:  # corrupt one position
            j = self.rng.randrange(len(truth))
            truth[j] = (truth[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return truth

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        k = min(self.rng.randint(1, self.max_len), budget)
        if k <= 0:
            return DraftTree()
        if self.shape == "chain":
            return DraftTree.chain(self._truth(tokens, k))
        path = self._truth(tokens, k)
        toks, parents = [], []
        prev = -1
        for depth, t in enumerate(path):
            # random siblings before and after the path node
            for _ in range(self.rng.randrange(3)):
                if len(toks) < budget - (len(path) - depth):
                    toks.append(self.rng.randrange(self.vocab))
                    parents.append(prev)
            toks.append(t)
            parents.append(prev)
            prev = len(toks) - 1
            if self.rng.random() < 0.3 and len(toks) < budget - (len(path) - depth - 1):
                toks.append(self.rng.randrange(self.vocab))
                parents.append(parents[-1])
        return DraftTree(toks[:budget], parents[:budget])


class CharTokenizer:
    """A stand-in tokenizer for stop-string tests: token i decodes to the letter ``a + i % 26``."""

    eos_token_id = None
    pad_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="session")
def smollm2_f32():
    import speculum

    return speculum.load("default", dtype="float32", weights="float")


@pytest.fixture(scope="session")
def gemma3_f32():
    import speculum

    return speculum.load("gemma3", dtype="float32", weights="float")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The default model as users get it: its GGUF weights kept quantized (float32 activations)."""
    import speculum

    return speculum.load("default", weights="gguf")


@pytest.fixture(scope="session")
def gemma3_gguf():
    import speculum

    return speculum.load("gemma3", weights="gguf")


@contextlib.contextmanager
def serving(state):
    """``state``'s app served on loopback (:func:`serve_in_thread`) for the ``with`` block, which
    gets ``(state, url)``; the server stops and ``state`` closes after it."""
    from speculum.server import create_app

    srv, thread, port = serve_in_thread(create_app(state))
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        state.close()


def openai_client(url: str):
    """The official client for a test server at ``url`` (no retries: a refusal must show)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, text: str, **kw):
    """A greedy one-message chat completion from ``smollm2``."""
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                          temperature=0, **kw)


def serve_in_thread(app):
    """Run the ASGI ``app`` under uvicorn on a free loopback port in a daemon thread; returns
    ``(server, thread, port)`` once it listens (stop it with ``server.should_exit = True``)."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    return srv, thread, port


def random_head(model, path, trimmed: bool = False, seed: int = 0, scale: float = 8.0, kind: str = "eagle",
                **config):
    """A ``kind`` head with random weights (``scale`` sharpens its output) saved to ``path``; ``trimmed``:
    a draft vocabulary of every third token; ``config``: the head config's options (``fuse_layers``)."""
    config_cls, module_cls = LEARNED[kind].config, LEARNED[kind].module
    torch.manual_seed(seed)
    if kind == "kangaroo":  # exit after the first layer (the tiny models have 2 to 4)
        config.setdefault("exit_layer", 1)
    head = module_cls(config_cls.for_target(model.config, **config))
    with torch.no_grad():
        if kind == "eagle":
            head.down.weight.mul_(scale)
        else:  # medusa / hydra start as the identity: make every head draft something else
            for name, p in head.named_parameters():
                if name.endswith("linear.weight"):
                    p.normal_(0, scale / p.shape[1] ** 0.5)
                elif name.endswith("proj.weight"):
                    p.add_(torch.randn_like(p) / p.shape[1] ** 0.5)
    width = model.get_output_embeddings().weight.shape[0]
    vocab = torch.arange(0, width, 3) if trimmed else None
    return save_head(path, kind, head, vocab, {"vocab": width})


def random_heads(model, folder, trimmed: bool = False, seed: int = 0) -> tuple:
    """One random head file of every kind, for methods that take several (``--draft-head a,b,c``)."""
    return tuple(random_head(model, Path(folder) / f"{kind}.safetensors", trimmed, seed, kind=kind)
                 for kind in LEARNED)


def committed_per_step(method, prompts, new: int = 40, ar=None) -> float:
    """Tokens ``method`` commits per target forward over ``prompts`` (``new`` tokens each), checking
    on the way that its output equals ``ar``'s where given."""
    total = steps = 0
    for p in prompts:
        r = method.run(p, new)
        if ar is not None:
            assert r.tokens == ar.run(p, new).tokens
        total += r.new_tokens
        steps += len(r.steps)
    return total / steps


def batched_join_midway(runner, engine, prompts, new: int = 40) -> list[list[int]]:
    """Decode ``prompts`` together in one slot pool, one forward per step, every other request
    joining mid-way (prefilled 7 tokens at a time alongside the others' decode steps); each request
    drafts with its own fork of ``engine``'s drafter. Returns each request's generated tokens."""
    from speculum.engine import step

    pool = runner.new_pool(len(prompts), 128)
    decodings = [engine.start(p, new, cache=pool.acquire(), drafter=engine.drafter.fork(), prefill=i % 2 == 0)
                 for i, p in enumerate(prompts)]
    while any(d.reason is None for d in decodings):
        live = [d for d in decodings if d.reason is None and d.prefilled]
        chunks = [(d, d.next_chunk(7)) for d in decodings if not d.prefilled]
        step(live, prefills=chunks)
    return [d.generated for d in decodings]
