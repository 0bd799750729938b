"""A GGUF model whose vocabulary is SentencePiece BPE (as LLaMA-2's, Mistral's and TinyLlama's
files are): a tiny random LLaMA with LLaMA-2's vocabulary, run by `tandem run --chat`. The
prompt is the LLaMA-2 template's, tokenized as the vocabulary alone tokenizes it, and the
reply's text is what its ids decode to."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from engine import registry
from engine.gguf_file import open_gguf
from engine.tokenizer import load_tokenizer
from services.cli import main
from tests.engine.tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.slow

# LLaMA-2's chat template, as its GGUFs carry it (shortened: no system prompt).
LLAMA2_CHAT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] "
    "+ ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def tiny_llama2(path: Path, vocabulary: Path) -> None:
    """Random weights of LLaMA's shapes, with LLaMA-2's vocabulary and a chat template."""
    source = open_gguf(vocabulary)
    tokens = source.require("tokenizer.ggml.tokens")

    def llama2(writer: gguf.GGUFWriter) -> int:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(source.require("tokenizer.ggml.scores"))
        writer.add_token_types(source.require("tokenizer.ggml.token_type"))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        return len(tokens)

    write_tiny_llama(path, llama2, LLAMA2_CHAT)


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
