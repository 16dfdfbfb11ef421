"""adapters/gguf_codes.py: the base GGUF's codes, unpacked bit for bit and in HF row order."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from streamfuse.adapters import hf
from streamfuse.adapters.base_model import base_gguf
from streamfuse.adapters.gguf_codes import GGUFError, _unpermute, read_base_codes, unpack_blocks

from conftest import make_tiny_llama, quantize_into_gguf


def fp16_bytes(value: float) -> list[int]:
    return list(np.array([value], dtype=np.float16).view(np.uint8))


def test_a_q4_1_block_unpacks_low_nibbles_first_then_high():
    # d = 0.5, m = -1; byte j holds element j (low nibble) and element j + 16 (high nibble)
    packed = [j | ((15 - j) << 4) for j in range(16)]
    codes = unpack_blocks("q4_1", np.array([fp16_bytes(0.5) + fp16_bytes(-1.0) + packed], dtype=np.uint8))
    assert codes.codes.tolist() == [list(range(16)) + list(range(15, -1, -1))]
    assert codes.scales.tolist() == [[0.5]] and codes.mins.tolist() == [[-1.0]]
    assert codes.dequantize().tolist() == [[0.5 * q - 1.0 for q in list(range(16)) + list(range(15, -1, -1))]]


def test_a_q8_0_block_keeps_its_int8_codes_shifted_by_128():
    values = list(range(-128, -96))  # 32 int8 codes
    raw = np.array([fp16_bytes(0.25) + list(np.array(values, dtype=np.int8).view(np.uint8))], dtype=np.uint8)
    codes = unpack_blocks("q8_0", raw)
    assert codes.codes.tolist() == [[v + 128 for v in values]]
    assert codes.mins is None
    assert codes.dequantize().tolist() == [[0.25 * v for v in values]]


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_dequantized_codes_equal_gguf_own_dequantization_bitwise(kind):
    weights = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = quants.quantize(weights, kind)
    ours = unpack_blocks(kind.name.lower(), raw).dequantize()
    assert np.array_equal(ours, quants.dequantize(raw, kind))


def test_codes_of_a_converted_model_are_its_weights_in_hf_row_order(tmp_path):
    """q and k rows come back from llama.cpp's rotary permutation (4 query heads, 2 K/V heads)."""
    model = make_tiny_llama()
    quantize_into_gguf(model, tmp_path / "model.gguf")
    parts = hf.decoder_parts(model)
    codes = read_base_codes(tmp_path / "model.gguf", parts.num_heads, parts.num_kv_heads)
    assert len(codes.layers) == parts.num_layers
    for index, layer in enumerate(codes.layers):
        for path, block in layer.items():
            weight = parts.layers[index].get_submodule(path).weight.detach().numpy()
            assert block.kind == "q4_1" and np.array_equal(block.dequantize(), weight), (index, path)
    assert codes.embedding.kind == "q8_0"
    assert np.array_equal(codes.embedding.dequantize(), parts.embed.weight.detach().numpy())
    # the file's own bytes: 7 linears x 4 layers of Q4_1 blocks plus the Q8_0 embedding
    blocks4 = sum(block.codes.size for layer in codes.layers for block in layer.values()) // 32
    assert codes.bytes() == blocks4 * 20 + 97 * 32 // 32 * 34


def test_unpermuted_rows_match_transformers_gguf_loader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48 * 32, dtype=np.float32).reshape(48, 32)
    theirs = LlamaTensorProcessor.__new__(LlamaTensorProcessor)._reverse_permute_weights
    raw = quants.quantize(rows, GGMLQuantizationType.Q8_0)  # row-wise: any permutation of rows is exact
    for heads in (4, 2):
        plain = quants.dequantize(raw, GGMLQuantizationType.Q8_0)
        ours = _unpermute(unpack_blocks("q8_0", raw), heads).dequantize()
        assert np.array_equal(ours, theirs(plain, heads, heads)) and not np.array_equal(ours, plain)


def test_a_file_that_is_not_gguf_or_another_type_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        read_base_codes(bad, 4, 2)


def test_a_model_folder_without_its_gguf_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no .gguf file"):
        base_gguf(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    assert base_gguf(str(tmp_path)) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="several .gguf files"):
        base_gguf(str(tmp_path))


def test_codes_of_another_model_are_refused(tmp_path):
    from streamfuse.adapters.config import StreamConfig
    from streamfuse.adapters.model import SpeculativeStreamingLM
    from streamfuse.export.low_bit import use_base_codes

    quantize_into_gguf(make_tiny_llama(seed=1), tmp_path / "other.gguf")
    model = SpeculativeStreamingLM(make_tiny_llama(seed=0), StreamConfig(3, 2))
    codes = read_base_codes(tmp_path / "other.gguf", 4, 2)
    with pytest.raises(GGUFError, match="not this model's base"):
        with torch.no_grad():
            use_base_codes(model, codes)
