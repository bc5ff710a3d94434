"""The native runner against transformers: logits, greedy output, cache, graph-shaped steps, selection.

Tiny random models of every supported family (Llama, with and without attention and MLP biases,
Qwen2 with QKV bias, Qwen3 with q/k norms,
Mistral whose window slides on every layer, Gemma-3 with mixed layers), float32. The packaged
models are covered by ``test_real_models.py``, which runs every drafter on the native runner.
"""

import random

import pytest
import torch
from conftest import TINY_VOCAB, OracleDrafter, tiny_gemma3, tiny_llama

from speculum.cache import StaticKVCache
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.runners import HFRunner, NativeDecoder, NativeRunner, runner_for, use_runner
from speculum.tree import DraftTree

WINDOW = 8


def _tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                  "attn_implementation": "sdpa", "eos_token_id": None, "pad_token_id": None, "bos_token_id": None}
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    elif kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    elif kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(**common, sliding_window=WINDOW))
    elif kind == "llama_bias":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True))
    elif kind == "llama":
        return tiny_llama(seed)
    else:
        return tiny_gemma3(seed, window=WINDOW)
    with torch.no_grad():  # random biases and norm weights, so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.generation_config.eos_token_id = None
    return model.eval()


KINDS = ["llama", "llama_bias", "qwen2", "qwen3", "mistral", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return _tiny(request.param)


def _random_tree(rng: random.Random, k: int) -> DraftTree:
    return DraftTree([rng.randrange(TINY_VOCAB) for _ in range(k)], [rng.randrange(-1, i) for i in range(k)])


def _compare_steps(model, native: NativeRunner, atol: float, steps: int = 12) -> None:
    """Prefill past the window, then tree forwards with random accepted paths: logits must agree."""
    hf = HFRunner(model)
    rng = random.Random(1)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(3 * WINDOW)]
    caches = hf.new_cache(128), native.new_cache(128)
    hf.prefill(caches[0], prompt)
    native.prefill(caches[1], prompt)
    for _ in range(steps):
        tree = _random_tree(rng, rng.randrange(0, 12))
        root = rng.randrange(TINY_VOCAB)
        want = hf.forward_tree(caches[0], root, tree)
        got = native.forward_tree(caches[1], root, tree)
        assert got.shape == want.shape == (len(tree) + 1, TINY_VOCAB)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        path = [0]
        node = rng.randrange(len(tree)) if len(tree) else -1
        chain = []
        while node >= 0:
            chain.append(node + 1)
            node = tree.parents[node]
        path += sorted(chain)
        for c in caches:
            c.commit(path)
    assert caches[0].length == caches[1].length > 3 * WINDOW


def test_logits_equal_hf_runner(model):
    """Eager native path: bit-for-bit the Hugging Face runner's float32 logits, trees included."""
    _compare_steps(model, NativeRunner(model), atol=0.0)


def test_graph_shaped_steps_match(model):
    """The padded fixed-shape steps CUDA graphs capture (run here without capture)."""
    native = NativeRunner(model, cuda_graphs="padded", graph_context=128)
    assert native.graphs is not None and not native.graphs.capture
    _compare_steps(model, native, atol=1e-5)


def test_graph_shaped_steps_return_hidden_states(model):
    """A graphed step that also returns hidden states (what the learned drafters read) gives the eager
    step's, for the embeddings, an inner layer and the final norm's output."""
    eager = NativeRunner(model)
    padded = NativeRunner(model, cuda_graphs="padded", graph_context=128)
    layers = (0, 1, eager.num_layers)
    rng = random.Random(5)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(2 * WINDOW)]
    caches = eager.new_cache(128), padded.new_cache(128)
    for runner, cache in zip((eager, padded), caches):
        runner.prefill(cache, prompt)
    for _ in range(6):
        tree, root = _random_tree(rng, rng.randrange(0, 10)), rng.randrange(TINY_VOCAB)
        want, got = (r.forward(c, root, tree, layers) for r, c in zip((eager, padded), caches))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
        assert sorted(got.hidden) == list(layers)
        for i in layers:
            assert got.hidden[i].shape == (len(tree) + 1, model.config.hidden_size)
            torch.testing.assert_close(got.hidden[i], want.hidden[i], rtol=0, atol=1e-5)
        for c in caches:
            c.commit([0])


def test_fused_kernels_match(model):
    """The GPU path's fused RMSNorm / rotary / KV write, run on the CPU."""
    native = NativeRunner(model)
    native.decoder = NativeDecoder.from_hf(model, fused=True)
    assert native.decoder.fused
    _compare_steps(model, native, atol=1e-5)


def test_greedy_equals_transformers_generate(model):
    """Plain decoding on the native runner = transformers' own generate (its masks, its cache)."""
    rng = random.Random(2)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(12)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                             min_new_tokens=40)[0, len(prompt):].tolist()
    assert Engine(NativeRunner(model), AutoregressiveDrafter()).generate(prompt, 40).tokens == ref


@pytest.mark.parametrize("graphs", [False, "padded"])
def test_tree_speculation_lossless(model, graphs):
    rng = random.Random(3)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(10)]
    native = NativeRunner(model, cuda_graphs=graphs, graph_context=128)
    ref = Engine(HFRunner(model), AutoregressiveDrafter()).generate(prompt, 48).tokens
    full = prompt + ref
    out = Engine(native, OracleDrafter(full, TINY_VOCAB, shape="tree", seed=4)).generate(prompt, 48)
    assert out.tokens == ref
    assert out.mean_accepted > 1.2


def test_static_cache_commit_and_rollback():
    cache = StaticKVCache(2, 1, 4, torch.float32, "cpu", capacity=8)
    cache.kv[:, :, 0, :6] = torch.arange(6.0)[:, None]  # slot i holds value i
    cache.pending = 6
    cache.commit([0, 2, 5])
    assert cache.length == 3 and cache.pending == 0
    assert cache.kv[1, 1, 0, :3, 0].tolist() == [0.0, 2.0, 5.0]
    cache.reserve(64)  # grows, keeps the committed entries
    assert cache.capacity >= 64 and cache.kv[0, 0, 0, :3, 0].tolist() == [0.0, 2.0, 5.0]
    cache.rollback(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.rollback(2)
    cache.pending = 2
    with pytest.raises(IndexError):
        cache.commit([0, 3])
    fixed = StaticKVCache(2, 1, 4, torch.float32, "cpu", 8, buffer=torch.zeros(2, 2, 1, 8, 4))
    with pytest.raises(ValueError):
        fixed.reserve(9)


def test_graph_buffer_goes_to_one_live_cache():
    native = NativeRunner(tiny_llama(), cuda_graphs="padded", graph_context=64)
    first = native.new_cache(32)
    assert first.fixed
    second = native.new_cache(32)  # the first is alive: a private cache, stepped eagerly
    assert not second.fixed
    native.prefill(second, [1, 2, 3])
    assert not native.new_cache(128).fixed  # longer than the graphs' buffer
    del first
    assert native.new_cache(32).fixed  # the buffer is free again
    other = NativeRunner(tiny_llama(), cuda_graphs="padded", graph_context=64)
    with pytest.raises(RuntimeError, match="belongs to another"):
        other.prefill(native.new_cache(32), [1])


def test_runner_selection():
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = tiny_llama(seed=5)
    assert isinstance(runner_for(llama), NativeRunner)
    assert isinstance(runner_for(llama, "hf"), HFRunner)
    use_runner(llama, "hf")
    assert isinstance(runner_for(llama), HFRunner)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    assert isinstance(runner_for(gpt2), HFRunner)  # auto falls back
    with pytest.raises(SpeculumError, match="native runner does not support"):
        runner_for(gpt2, "native")
    with pytest.raises(SpeculumError, match="unknown runner"):
        use_runner(llama, "fast")


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("gemma3", torch.float32),
                                        ("llama", torch.bfloat16)])
def test_release_model_weights(kind, dtype):
    """Dropping transformers' copies of the layer weights changes no output; the hf paths then refuse."""
    from speculum.runners import packed_linear, release_model_weights

    model = _tiny(kind, seed=7).to(dtype)
    prompt = list(range(3, 3 + 3 * WINDOW))
    native = runner_for(model, "native")
    before = Engine(native, AutoregressiveDrafter()).generate(prompt, 24).tokens
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    kept = [m for layer in model.model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    shared = sum(m.weight.numel() * m.weight.element_size() for m in kept)
    packed = packed_linear(linears[0].weight) is not None
    freed = release_model_weights(model)
    # unfused float32 keeps o_proj and down_proj in place (shared); packed bfloat16 copies every linear
    assert freed == (total if packed else total - shared)
    assert all(m.weight.device.type == "meta" for m in linears)
    assert Engine(runner_for(model), AutoregressiveDrafter()).generate(prompt, 24).tokens == before
    with pytest.raises(SpeculumError, match="released"):
        runner_for(model, "hf")
    with pytest.raises(SpeculumError, match="released"):
        build_method("hf", model, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_cuda_graphs_match_hf_runner(kind):
    model = _tiny(kind).cuda()
    native = NativeRunner(model, graph_context=256)
    assert native.graphs is not None and native.graphs.capture
    _compare_steps(model, native, atol=1e-4, steps=20)
    assert native.graphs.graphs  # steps really replayed captured graphs


@pytest.mark.parametrize("mask_shape", [None, (12, 40), (5, 1, 12, 40), (1, 1, 12, 40), (5, 1, 1, 40)])
@pytest.mark.parametrize("row_blocks", [False, True])
def test_blocked_math_attention_matches_one_piece(monkeypatch, mask_shape, row_blocks):
    """The math path computed in pieces (scores over SCORE_BLOCK_BYTES) equals it in one piece, for
    every mask layout the runners pass (bit for bit while whole matrices are kept, as the reproducible
    mode's decoding groups need); keys may be a strided view of a cache with spare room."""
    from speculum import attention as att

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 12, 16, generator=gen)
    kv = torch.randn(2, 5, 3, 64, 16, generator=gen)
    k, v = kv[0, :, :, :40], kv[1, :, :, :40]  # [5, 3, 40, 16], not contiguous
    mask = None
    if mask_shape is not None:
        mask = torch.zeros(mask_shape).masked_fill_(torch.rand(mask_shape, generator=gen) < 0.3, float("-inf"))
        mask[..., 0] = 0.0  # every row sees a key
    whole = att.folded_attention(q, k, v, mask, 0.25, True, softcap=5.0)
    for budget in (12 * 40 * 4 * 2, 12 * 40 * 4, 40 * 4 * 5):  # runs of entries, one matrix, runs of rows
        monkeypatch.setattr(att, "SCORE_BLOCK_BYTES", budget)
        pieces = att.folded_attention(q, k, v, mask, 0.25, True, softcap=5.0, row_blocks=row_blocks)
        if budget >= 12 * 40 * 4:  # whole matrices: each computed as in one piece, bit for bit
            assert torch.equal(pieces, whole)
        else:
            torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)


def test_math_attention_takes_long_contexts_on_a_cpu(monkeypatch):
    """A few rows go to SDPA over a short context and to the math path over a long one (scaled by the
    kernel threads); GPUs always take SDPA. Both kernels give the same attention."""
    from speculum import attention as att

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    long = 2 * att.MATH_ATTENTION_KEYS_PER_THREAD
    assert not att.use_math_attention(3, cpu, 100) and not att.use_math_attention(3, cpu, long - 1)
    assert att.use_math_attention(3, cpu, long) and att.use_math_attention(att.MATH_ATTENTION_MIN_ROWS, cpu, 10)
    assert not att.use_math_attention(3, cuda, long) and not att.use_math_attention(64, cuda, 10)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 16, generator=gen)  # [n, H, d]
    k, v = (torch.randn(3, 9000, 16, generator=gen) for _ in range(2))  # [H_kv, L, d]
    qg = att.fold_queries(q, 3)[None]
    torch.testing.assert_close(att.folded_attention(qg, k[None], v[None], None, 0.25, math=True),
                               att.folded_attention(qg, k[None], v[None], None, 0.25, math=False))


def test_float32_packing_takes_large_matrices_and_keeps_their_products():
    """Float32 linears are prepacked from MIN_FLOAT32_PACKED weights (where oneDNN's blocked kernel
    pays), tiny ones stay on F.linear, and a packed product equals F.linear's to float32 rounding
    for one to many rows, the 2-3 row inputs F.linear handles slowest among them."""
    from speculum.runners.packed import MIN_FLOAT32_PACKED, packed_linear, packs

    torch.manual_seed(0)
    assert packed_linear(torch.randn(64, 64)) is None
    if not packs(torch.float32):
        pytest.skip("this torch has no oneDNN")
    w, b = torch.randn(MIN_FLOAT32_PACKED // 512, 512), torch.randn(MIN_FLOAT32_PACKED // 512)
    linear = packed_linear(w, b)
    assert linear is not None
    for rows in (1, 2, 3, 8, 40):
        x = torch.randn(rows, 512)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert linear(torch.randn(2, 3, 512)).shape == (2, 3, MIN_FLOAT32_PACKED // 512)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_attention_over_a_nearly_full_buffer_spans_it(kind, monkeypatch):
    """A step over most of a KV buffer attends over the whole (contiguous) buffer with the slots past
    its keys masked, instead of copying a slice of it: the logits equal those of the same step in a
    roomy buffer, also after a rollback has left stale entries in the masked slots (float32)."""
    from speculum import attention as att

    model = _tiny(kind, seed=3)
    runner = NativeRunner(model)
    rng = random.Random(0)
    prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(4 * WINDOW * 3)]  # past the sliding window
    tree = DraftTree([rng.randrange(3, TINY_VOCAB) for _ in range(9)], [-1, 0, 0, 1, 2, 2, 3, 6, 7])
    rows = (len(tree.tokens) + 1) * model.config.num_attention_heads // model.config.num_key_value_heads
    tight = len(prompt) + len(tree.tokens) + 1 + 4  # 4 slots to spare: within 1/SPAN_SLACK
    assert att.capacity_span(tight - 4, tight, rows, torch.device("cpu"))
    taken = []
    real = att.span_mask
    monkeypatch.setattr("speculum.runners.decoder.span_mask", lambda *a: taken.append(a) or real(*a))
    logits = {}
    for capacity in (tight, 4 * tight):
        cache = runner.new_cache(capacity)
        runner.prefill(cache, prompt)
        first = runner.forward_tree(cache, 7, tree)
        cache.pending = 0  # a rollback: the drafted entries stay behind, masked
        logits[capacity] = (first, runner.forward_tree(cache, 8, DraftTree.chain(tree.tokens[:7])))
    assert taken, "the tight buffer was not spanned"
    for a, b in zip(logits[tight], logits[4 * tight]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # end to end: the engine's buffer (prompt + reply + tree room) fills up, and its trees, spanned
    # in the late steps, give ar's greedy tokens (ar's one-token steps over a short context do not span)
    prompt = prompt[:150]
    ref = Engine(runner, AutoregressiveDrafter()).generate(prompt, 48).tokens
    taken.clear()
    drafter = OracleDrafter(prompt + ref, TINY_VOCAB, max_len=8, shape="tree", seed=5)
    assert Engine(runner, drafter, max_tree=8).generate(prompt, 48).tokens == ref
    assert taken, "no step was spanned"


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_hf_compiled_decodes_as_hf(kind):
    """``hf_compiled`` (transformers' static cache, compiled on a GPU) gives plain ``hf``'s greedy output."""

    class Tokenizer:  # what transformers' generate and the method read of one
        pad_token_id, eos_token_id = None, TINY_VOCAB - 1

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    model = _tiny(kind)
    prompt = list(range(3, 40))
    ref = build_method("hf", model, Tokenizer()).run(prompt, 16)
    out = build_method("hf_compiled", model, Tokenizer()).run(prompt, 16)
    assert out.tokens == ref.tokens and len(out.tokens) > 4


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_sliding_layers_skip_keys_a_window_behind(kind, monkeypatch):
    """Past ``WINDOW_SKIP_MIN`` hidden slots a sliding-window layer reads only the slots from a window
    behind the step's first row: the logits stay transformers' (to rounding), each sliding layer's read
    is a window plus the step's rows long, full layers still read everything, and tree speculation
    under these reads gives plain decoding's greedy tokens (float32)."""
    import speculum.attention as attention_mod
    import speculum.cache.store as store_mod

    monkeypatch.setattr(attention_mod, "WINDOW_SKIP_MIN", 1)
    reads = []  # (sliding, keys read)
    real_read = store_mod.BufferStore.read
    monkeypatch.setattr(store_mod.BufferStore, "read",
                        lambda self, layer, sliding, q: reads.append((sliding, self.keys - (self.window_start if sliding else 0)))
                        or real_read(self, layer, sliding, q))
    model = _tiny(kind, seed=2)
    _compare_steps(model, NativeRunner(model), atol=1e-5)
    sliding = [n for s, n in reads if s]
    assert sliding and max(sliding) <= WINDOW - 1 + 3 * WINDOW  # the prompt's one chunk: window + its rows
    assert max(n for s, n in reads[-8:] if s) <= WINDOW - 1 + 13  # a tree step: window + root and 12 nodes
    if kind == "gemma3":  # its global layers read the whole cache
        assert max(n for s, n in reads if not s) > 3 * WINDOW
    rng = random.Random(6)
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(3 * WINDOW)]
    ref = Engine(HFRunner(model), AutoregressiveDrafter()).generate(prompt, 40).tokens
    native = NativeRunner(model)
    assert Engine(native, AutoregressiveDrafter()).generate(prompt, 40).tokens == ref
    drafter = OracleDrafter(prompt + ref, TINY_VOCAB, shape="tree", seed=7)
    assert Engine(native, drafter).generate(prompt, 40).tokens == ref
