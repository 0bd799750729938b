"""load_tokenizer: which tokenizer a path holds, and clear errors for what it does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers

from engine.errors import ModelFormatError, ModelNotFound
from engine.tokenizer import Llama3Tokenizer, Tokenizer, load_tokenizer
from engine.tokenizer.hf_backed import HFBackedTokenizer


def test_gguf_file(default_gguf: Path, smollm: Tokenizer) -> None:
    tokenizer = load_tokenizer(default_gguf)
    assert isinstance(tokenizer, HFBackedTokenizer)
    text = "<|im_start|>user\n2  cats<|im_end|>"
    assert tokenizer.encode(text, allow_special=True) == smollm.encode(text, allow_special=True)


def test_tiktoken_file_and_a_folder_holding_it(
    llama3_tokenizer_model: Path, tmp_path: Path
) -> None:
    assert isinstance(load_tokenizer(llama3_tokenizer_model), Llama3Tokenizer)
    shutil.copy(llama3_tokenizer_model, tmp_path / "tokenizer.model")
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, Llama3Tokenizer)
    assert tokenizer.encode("<|eot_id|>", allow_special=True) == [128009]


def test_folder_with_tokenizer_json(tmp_path: Path, spm_spec: dict[str, object]) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps(spm_spec))
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")  # tokenizer.json wins
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, HFBackedTokenizer)
    library = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("hello world", allow_special=True) == library.encode("hello world").ids


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="nothing-here"):
        load_tokenizer(tmp_path / "nothing-here")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("model.gguf", b"GGUX\x00\x00", "no GGUF magic"),
        ("tokenizer.model", b"\x0a\x0b\x00sentencepiece", "not a tiktoken BPE file"),
        ("notes.txt", b"hello\n", "is not a tokenizer"),
        ("empty.bin", b"", "is not a tokenizer"),
    ],
)
def test_files_that_are_not_tokenizers(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match=message):
        load_tokenizer(path)


def test_truncated_gguf_and_corrupt_tiktoken(tmp_path: Path, default_gguf: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    with default_gguf.open("rb") as f:
        truncated.write_bytes(f.read(4096))
    with pytest.raises(ModelFormatError):
        load_tokenizer(truncated)
    corrupt = tmp_path / "tokenizer.model"
    corrupt.write_text("IQ== 0\nIg== 1\nnot-base64!! 2\n")
    with pytest.raises(ModelFormatError, match=":3:"):
        load_tokenizer(corrupt)
    gapped = tmp_path / "gapped" / "tokenizer.model"
    gapped.parent.mkdir()
    gapped.write_text("IQ== 0\nIg== 5\n")
    with pytest.raises(ModelFormatError, match="ranks"):
        load_tokenizer(gapped)


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match=r"neither tokenizer\.json nor tokenizer\.model"):
        load_tokenizer(tmp_path)
