"""Choosing the tokenizer a path holds: GGUF file, tiktoken BPE file or tokenizer.json folder."""

from __future__ import annotations

import re
from pathlib import Path

from engine.errors import ModelFormatError, ModelNotFound
from engine.gguf_file import open_gguf
from engine.tokenizer.base import Tokenizer
from engine.tokenizer.gguf_bpe import gguf_tokenizer
from engine.tokenizer.hf_folder import hf_folder_tokenizer
from engine.tokenizer.llama3 import Llama3Tokenizer

_GGUF_MAGIC = b"GGUF"
# A tiktoken BPE file is lines of "<base64 token> <rank>".
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+\r?$")


def _file_tokenizer(path: Path) -> Tokenizer:
    with path.open("rb") as f:
        first_line = f.readline(4096)
    if first_line.startswith(_GGUF_MAGIC):
        return gguf_tokenizer(open_gguf(path))
    if _TIKTOKEN_LINE.match(first_line.rstrip(b"\n")):
        return Llama3Tokenizer(path)
    if path.suffix == ".gguf":
        raise ModelFormatError(f"{path.name} is not a GGUF file (no GGUF magic)")
    if path.name == "tokenizer.model":
        raise ModelFormatError(
            f"{path} is not a tiktoken BPE file (a SentencePiece model?); "
            "only LLaMA-3's tiktoken tokenizer.model is supported"
        )
    raise ModelFormatError(
        f"{path} is not a tokenizer: expected a .gguf file, a tiktoken tokenizer.model, "
        "or a folder with tokenizer.json"
    )


def load_tokenizer(path: Path) -> Tokenizer:
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return hf_folder_tokenizer(path)
        if (path / "tokenizer.model").is_file():
            return _file_tokenizer(path / "tokenizer.model")
        raise ModelFormatError(f"{path} holds neither tokenizer.json nor tokenizer.model")
    if path.is_file():
        return _file_tokenizer(path)
    raise ModelNotFound(f"no such tokenizer file or folder: {path}")
