"""The GGUF tensor directory reader (``speculum.weights.gguf_tensors``) against ``gguf.GGUFReader``, and
the GGUF -> transformers name map against transformers' own."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_gemma3, tiny_llama

from speculum.weights.gguf_load import gguf_to_hf_names
from speculum.weights.gguf_tensors import GGUFTensors


def _write_gguf(path, alignment: int | None = None):
    """A small GGUF file: metadata of every kind (string arrays as a tokenizer's, nested arrays,
    scalars), float and quantized tensors."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5 + 1) for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    w.add_uint64("test.u64", 7)
    w.add_float32("test.f32", 0.5)
    w.add_bool("test.flag", True)
    w.add_string("test.text", "héllo")
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("half.weight", rng.standard_normal((3, 32)).astype(np.float16))
    for name, qtype in (("q8.weight", "Q8_0"), ("q4.weight", "Q4_1")):
        t = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(rng.standard_normal((5, 96)).astype(np.float32), t),
                     raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_finds_the_tensors_gguf_finds(tmp_path, alignment):
    import gguf

    path = tmp_path / "small.gguf"
    _write_gguf(path, alignment)
    ours, ref = GGUFTensors(path), gguf.GGUFReader(str(path))
    assert ours.architecture == "llama"
    assert ours.alignment == (alignment or 32)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type
        assert (a.data_offset, a.n_bytes) == (int(b.data_offset), int(b.n_bytes))
        assert list(a.shape) == list(reversed(b.shape.tolist()))
        assert np.array_equal(gguf.quants.dequantize(a.data, a.tensor_type).reshape(a.shape),
                              gguf.quants.dequantize(b.data, b.tensor_type).reshape(a.shape))


def test_reader_refuses_what_is_not_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFTensors(bad)
    path = tmp_path / "small.gguf"
    _write_gguf(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="past the end"):
        GGUFTensors(cut)


@pytest.mark.parametrize("arch, make", [("llama", tiny_llama), ("gemma3", tiny_gemma3)])
def test_names_are_transformers_names(arch, make):
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    model = make()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = gguf_to_hf_names(model, processor, arch)
    assert names == get_gguf_hf_weights_map(model, processor)
    assert names["blk.1.attn_q.weight"] == "model.layers.1.self_attn.q_proj.weight"
