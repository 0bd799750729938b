"""A tiny random LLaMA written as a GGUF, around whatever vocabulary a test gives it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS = 32, 64, 2, 4


def write_tiny_llama(
    path: Path, vocabulary: Callable[[gguf.GGUFWriter], int], chat_template: str
) -> None:
    """Random weights of LLaMA's shapes; `vocabulary` adds the tokenizer's metadata and returns
    how many tokens it has."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    size = vocabulary(writer)
    writer.add_vocab_size(size)
    writer.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int, norm: bool = False) -> None:
        w = rng.standard_normal(shape).astype(np.float32) * 0.05
        writer.add_tensor(name, 1 + w if norm else w)

    add("token_embd.weight", size, HIDDEN)
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
    add("output.weight", size, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
