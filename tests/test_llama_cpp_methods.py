"""The llama.cpp reference methods (``llama_cpp``, ``llama_cpp_lookup``): their refusals without
llama-cpp-python, and, where it is installed (``make llama``), greedy tokens on the packaged model."""

import sys

import pytest
from conftest import tiny_llama

from speculum import methods
from speculum.errors import SpeculumError
from speculum.methods import LlamaCppMethod, build_method, check_method, gguf_path
from speculum.sampling import SamplingParams


def test_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    for name in ("llama_cpp", "llama_cpp_lookup"):
        with pytest.raises(SpeculumError, match="make llama"):
            check_method(name, has_draft_model=False)


def test_gguf_only(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpeculumError, match="GGUF files only"):
        gguf_path(str(tmp_path), "llama_cpp")


def test_model_not_loaded_by_name_refused(monkeypatch):
    monkeypatch.setattr(methods, "_llama_cpp", lambda: None)
    model = tiny_llama()
    with pytest.raises(SpeculumError, match="GGUF file the model was loaded from"):
        build_method("llama_cpp", model, None)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7), SamplingParams(repetition_penalty=1.2),
                                      SamplingParams(presence_penalty=0.5)])
def test_greedy_only(monkeypatch, sampling):
    monkeypatch.setattr(methods, "_llama_cpp", lambda: None)
    method = LlamaCppMethod("llama_cpp", "unused.gguf", None, [0], 2048)
    with pytest.raises(SpeculumError, match="greedy only"):
        method.run([1, 2, 3], 8, sampling)
    with pytest.raises(SpeculumError, match="no grammar"):
        method.run([1, 2, 3], 8, grammar=object())


@pytest.mark.slow
def test_llama_cpp_greedy_and_lookup_agree():
    """Prompt lookup verifies several tokens in one llama.cpp batch, whose logits round differently
    from one-token evaluations: its output equals plain greedy's up to a near tie, where it may not."""
    pytest.importorskip("llama_cpp")
    import numpy as np
    from llama_cpp import Llama

    import speculum
    from speculum.prompts import encode_prompt

    model, tok = speculum.load("default", dtype="float32")
    plain, lookup = (build_method(name, model, tok) for name in ("llama_cpp", "llama_cpp_lookup"))
    prompts = ["Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape.",
               "What are the three primary colors? Explain briefly."]
    saved = 0
    for text in prompts:
        ids = encode_prompt(tok, text, None)
        a, b = plain.run(ids, 40), lookup.run(ids, 40)
        assert a.new_tokens > 0 and a.finish_reason in ("eos", "length")
        assert a.forwards == a.new_tokens  # one evaluation per token, the prefill's included
        assert plain.run(ids, 40).tokens == a.tokens  # each run starts from an empty cache
        saved += a.forwards - b.forwards
        if b.tokens == a.tokens:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
        llm = Llama(model_path=plain.path, n_ctx=512, n_batch=512, logits_all=True, verbose=False)
        llm.eval(ids)
        for t in a.tokens[:i]:
            llm.eval([t])
        row = np.asarray(llm.scores[len(ids) + i - 1])
        assert row[a.tokens[i]] - row[b.tokens[i]] < 0.1, f"prompt lookup differs at {i} without a near tie"
    assert saved > 0  # the repeated list is drafted from the prompt
