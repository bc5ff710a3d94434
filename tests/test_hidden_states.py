"""Hidden states from the runners equal transformers' ``output_hidden_states`` (float32).

Every layer (0: embeddings, i: the i-th layer's output, the last: the final norm's output), from a
prefill and from a tree forward, where each node's row must equal a plain forward over its
root-to-node path; on tiny Llama and Gemma-3 (sliding window 8, shorter than the sequences), on the
native and the Hugging Face runners, and through a KV policy that keeps everything.
"""

import random

import pytest
import torch
from conftest import TINY_VOCAB, tiny_gemma3, tiny_llama

from speculum.errors import SpeculumError
from speculum.kv import make_policy
from speculum.runners import HFRunner, NativeRunner, PolicyRunner
from speculum.tree import DraftTree

ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_llama(seed=2) if request.param == "llama" else tiny_gemma3(seed=2)


def _reference(model, seq: list[int]) -> list[torch.Tensor]:
    """transformers' hidden states of ``seq``: ``num_layers + 1`` tensors ``[len(seq), D]``."""
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_hidden_states=True)
    return [h[0].float() for h in out.hidden_states]


def _runners(model):
    native = NativeRunner(model)
    return {"native": native, "hf": HFRunner(model),
            "policy": PolicyRunner(native, make_policy("snapkv", "100000"))}


@pytest.mark.parametrize("kind", ["native", "hf", "policy"])
@pytest.mark.parametrize("seed", range(3))
def test_tree_hidden_states_equal_per_path_recomputation(model, kind, seed):
    rng = random.Random(seed)
    runner = _runners(model)[kind]
    layers = list(range(model.config.num_hidden_layers + 1))
    prefix = [rng.randrange(1, TINY_VOCAB) for _ in range(rng.randint(12, 30))]
    cache = runner.new_cache(64)
    runner.prefill(cache, prefix[:-1])
    n = rng.randint(1, 12)
    tree = DraftTree([rng.randrange(TINY_VOCAB) for _ in range(n)], [rng.randrange(-1, i) for i in range(n)])
    out = runner.forward(cache, prefix[-1], tree, hidden_layers=layers)
    assert sorted(out.hidden) == layers
    ref = _reference(model, prefix)
    for k in layers:
        assert out.hidden[k].shape == (n + 1, model.config.hidden_size)
        torch.testing.assert_close(out.hidden[k][0].float(), ref[k][-1], atol=ATOL, rtol=0)
    for i in range(n):
        ref = _reference(model, prefix + [tree.tokens[j] for j in tree.path_to(i)])
        for k in layers:
            torch.testing.assert_close(out.hidden[k][i + 1].float(), ref[k][-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_prefill_hidden_states_equal_transformers(model, kind):
    rng = random.Random(5)
    runner = _runners(model)[kind]
    runner.prefill_chunk = 7  # several chunks
    prompt = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    cache = runner.new_cache(32)
    last = model.config.num_hidden_layers
    hidden = runner.prefill(cache, prompt, hidden_layers=[0, 1, last])
    ref = _reference(model, prompt)
    for k in (0, 1, last):
        torch.testing.assert_close(hidden[k].float(), ref[k], atol=ATOL, rtol=0)
    assert cache.length == len(prompt)


def test_no_hidden_states_unless_asked(model):
    runner = NativeRunner(model)
    cache = runner.new_cache(16)
    runner.prefill(cache, [1, 2, 3])
    assert runner.forward(cache, 4, DraftTree.chain([5, 6])).hidden == {}
    with pytest.raises(SpeculumError, match="hidden-state layers"):
        runner.forward(cache, 4, DraftTree(), hidden_layers=[model.config.num_hidden_layers + 1])
