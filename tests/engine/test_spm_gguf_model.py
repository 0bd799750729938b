"""A GGUF model whose vocabulary is SentencePiece BPE (as LLaMA-2's, Mistral's and TinyLlama's
files are): a tiny random LLaMA with LLaMA-2's vocabulary, run by `tandem run --chat`. The
prompt is the LLaMA-2 template's, tokenized as the vocabulary alone tokenizes it, and the
reply's text is what its ids decode to."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine import registry
from engine.gguf_file import open_gguf
from engine.tokenizer import load_tokenizer
from services.cli import main

pytestmark = pytest.mark.slow

HIDDEN, FFN, LAYERS, HEADS = 32, 64, 2, 4
# LLaMA-2's chat template, as its GGUFs carry it (shortened: no system prompt).
LLAMA2_CHAT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] "
    "+ ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def tiny_llama2(path: Path, vocabulary: Path) -> None:
    """Random weights of LLaMA's shapes, with LLaMA-2's vocabulary and a chat template."""
    source = open_gguf(vocabulary)
    tokens = source.require("tokenizer.ggml.tokens")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(source.require("tokenizer.ggml.scores"))
    writer.add_token_types(source.require("tokenizer.ggml.token_type"))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(LLAMA2_CHAT)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int, norm: bool = False) -> None:
        w = rng.standard_normal(shape).astype(np.float32) * 0.05
        writer.add_tensor(name, 1 + w if norm else w)

    add("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        for name, shape in (
            ("attn_q", (HIDDEN, HIDDEN)),
            ("attn_k", (HIDDEN, HIDDEN)),
            ("attn_v", (HIDDEN, HIDDEN)),
            ("attn_output", (HIDDEN, HIDDEN)),
            ("ffn_gate", (FFN, HIDDEN)),
            ("ffn_up", (FFN, HIDDEN)),
            ("ffn_down", (HIDDEN, FFN)),
        ):
            add(f"blk.{i}.{name}.weight", *shape)
        add(f"blk.{i}.attn_norm.weight", HIDDEN, norm=True)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN, norm=True)
    add("output_norm.weight", HIDDEN, norm=True)
    add("output.weight", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_sentencepiece_gguf_chats(
    capsys: pytest.CaptureFixture[str], tandem_home: Path, tmp_path: Path
) -> None:
    vocabulary = registry.resolve("llama2", tandem_home, quiet=True)
    model = tmp_path / "tiny-llama2.gguf"
    tiny_llama2(model, vocabulary)
    argv = ["run", "--model", str(model), "--chat", "--prompt", "Bonjour, ça va? 😀"]
    code = main([*argv, "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    tokenizer = load_tokenizer(vocabulary)
    want = tokenizer.encode("[INST] Bonjour, ça va? 😀 [/INST]", allow_special=False)
    assert out["prompt_token_ids"] == [1, *want]  # the template's <s>, as the token
    assert len(out["token_ids"]) == 8
    assert out["text"] == load_tokenizer(model).decode(out["token_ids"], skip_special=True)
