"""GGUF files of every supported tensor type load into the right model; bad files fail clearly.

Each file is written here the way llama.cpp's converter writes a LLaMA: Q/K rows permuted for
interleaved RoPE. The reference is transformers' LlamaForCausalLM given the same (dequantized)
weights, so the loader's naming, shapes and un-permutation are all checked.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine import registry
from engine.errors import ModelFormatError, ModelNotFound
from engine.loader import load_model
from engine.rope import inverse_frequencies

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB, CTX = 256, 512, 2, 4, 2, 300, 128
HEAD_DIM = HIDDEN // HEADS
# Bytes per 256-value block and the byte offsets of their fp16 scale fields, for the k-quants
# that gguf-py cannot quantize: their blocks are random bytes with sane scales.
K_QUANT_BLOCKS = {
    Q.Q4_K: (144, (0, 2)),
    Q.Q5_K: (176, (0, 2)),
    Q.Q6_K: (210, (208,)),
    Q.Q2_K: (84, (80, 82)),
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_QUANT_BLOCKS:
        size, scale_offsets = K_QUANT_BLOCKS[qtype]
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, size), dtype=np.uint8)
        for off in scale_offsets:
            blocks[..., off : off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        return blocks.reshape(w.shape[0], -1)
    return quantize(w, qtype)


def write_gguf(
    path: Path, qtype: Q, rope_factors: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Writes a random LLaMA GGUF; returns its weights as the reader must see them (HF layout)."""
    rng = np.random.default_rng(int(qtype))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CTX)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    hf: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, w: np.ndarray, kind: Q, heads: int = 0) -> None:
        stored = llama_cpp_permute(w, heads) if heads else w
        raw = encode(stored, kind, rng) if kind != Q.F32 else stored
        writer.add_tensor(name, raw, raw_dtype=kind if kind != Q.F32 else None)
        seen = dequantize(raw, kind).reshape(stored.shape) if kind != Q.F32 else stored
        # What the engine should end up with: the dequantized values, un-permuted.
        hf[hf_name] = llama_cpp_permute_inverse(seen, heads) if heads else seen

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(VOCAB, HIDDEN), qtype)
    for i in range(LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", rand(HIDDEN, HIDDEN), qtype, HEADS)
        add(
            p + "attn_k.weight",
            h + "self_attn.k_proj.weight",
            rand(KV_HEADS * HEAD_DIM, HIDDEN),
            qtype,
            KV_HEADS,
        )
        add(
            p + "attn_v.weight",
            h + "self_attn.v_proj.weight",
            rand(KV_HEADS * HEAD_DIM, HIDDEN),
            qtype,
        )
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", rand(HIDDEN, HIDDEN), qtype)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(FFN, HIDDEN), qtype)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", rand(FFN, HIDDEN), qtype)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", rand(HIDDEN, FFN), qtype)
        add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + rand(HIDDEN), Q.F32)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + rand(HIDDEN), Q.F32)
    add("output_norm.weight", "model.norm.weight", 1 + rand(HIDDEN), Q.F32)
    add("output.weight", "lm_head.weight", rand(VOCAB, HIDDEN), qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def llama_cpp_permute_inverse(w: np.ndarray, n_heads: int) -> np.ndarray:
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def reference_model(weights: dict[str, np.ndarray], rope_scaling: dict | None = None):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CTX,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rope_scaling=rope_scaling,
    )
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
    return model


def logits_of(path: Path, reference, quantize: str) -> tuple[torch.Tensor, torch.Tensor, str]:  # type: ignore[no-untyped-def]
    from engine.batch import SeqInput
    from engine.engine import Engine

    loaded = load_model(path, torch.device("cpu"), torch.float32, False, quantize)
    engine = Engine(loaded, 16, 16)
    ids = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = engine.model.logits(engine.forward([SeqInput("s", ids, 0, list(range(6)))]))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    return ours, expected, loaded.linear_format


def check_against_reference(path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ours, expected, _ = logits_of(path, reference, "none")
    assert float((ours - expected).abs().max() / expected.abs().max()) <= 1e-4


@pytest.mark.parametrize(
    "qtype",
    [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
    ids=lambda q: q.name,
)
def test_every_supported_type_loads_like_transformers(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    weights = write_gguf(path, qtype)
    check_against_reference(path, reference_model(weights))
    assert load_model(path, torch.device("cpu"), torch.float32, False).weight_format == (
        f"gguf:{qtype.name}"
    )


@pytest.mark.parametrize("quantize", ["auto", "int4"])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_weights_stay_quantized_on_cpu(tmp_path: Path, qtype: Q, quantize: str) -> None:
    """The kept codes serve the very same weights, with matmul inputs rounded (int8 blocks in the
    native kernel, bf16 in torch's int4 one): error at that level."""
    from engine import cpu_kernels

    path = tmp_path / f"kept-{qtype.name}.gguf"
    reference = reference_model(write_gguf(path, qtype))
    ours, expected, linear = logits_of(path, reference, quantize)
    native = quantize == "auto" and cpu_kernels.load()
    assert linear.startswith("native-codes" if native else "int4")
    assert float((ours - expected).abs().max() / expected.abs().max()) <= 3e-2
    assert float((ours.argmax(-1) == expected.argmax(-1)).float().mean()) >= 0.9


def test_rope_freqs_tensor_applies_llama3_scaling(tmp_path: Path) -> None:
    from engine.config import RopeScaling

    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    plain = inverse_frequencies(HEAD_DIM, 10000.0)
    scaled = inverse_frequencies(HEAD_DIM, 10000.0, RopeScaling(8.0, 1.0, 4.0, 16))
    path = tmp_path / "rope.gguf"
    weights = write_gguf(path, Q.F32, rope_factors=(plain / scaled).numpy())
    check_against_reference(path, reference_model(weights, rope_scaling=scaling))


def test_unsupported_quant_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    write_gguf(path, Q.Q2_K)
    with pytest.raises(ModelFormatError, match="Q2_K"):
        load_model(path, torch.device("cpu"), torch.float32, progress=False)


def test_truncated_and_garbage_files_are_format_errors(tmp_path: Path, default_gguf: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_gguf.read_bytes()[:100_000])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 100)
    for path in (truncated, garbage):
        with pytest.raises(ModelFormatError, match=path.name):
            load_model(path, torch.device("cpu"), torch.float32, progress=False)


def test_missing_paths_and_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="no such"):
        load_model(tmp_path / "absent.gguf", torch.device("cpu"), torch.float32, False)
    with pytest.raises(ModelNotFound, match="smollm2-135m-instruct"):
        registry.resolve("no-such-model", tmp_path)
    with pytest.raises(ModelNotFound, match="no such file"):
        registry.resolve(str(tmp_path / "missing.gguf"), tmp_path)
