"""Session fixtures for the tokenizer tests: each slow load (GGUF metadata, transformers, Meta's
reference tokenizer, the LLaMA-3 tokenizer.json conversion) happens once per run."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from engine.gguf_file import GGUFFile, open_gguf
from engine.tokenizer import Llama3Tokenizer, Tokenizer, gguf_tokenizer
from engine.tokenizer.llama3 import SPECIAL_TOKENS
from engine.tokenizer.pre_tokenizers import LLAMA3_PATTERN

META_WHEEL = "llama_models-0.3.0-py3-none-any.whl"
META_MODULES = (
    "llama_models/__init__.py",
    "llama_models/tokenizer_utils.py",
    "llama_models/llama3/__init__.py",
    "llama_models/llama3/tokenizer.py",
)


@pytest.fixture(scope="session")
def smollm_gguf(default_gguf: Path) -> GGUFFile:
    return open_gguf(default_gguf)


@pytest.fixture(scope="session")
def smollm(smollm_gguf: GGUFFile) -> Tokenizer:
    return gguf_tokenizer(smollm_gguf)


@pytest.fixture(scope="session")
def llama3(llama3_tokenizer_model: Path) -> Tokenizer:
    return Llama3Tokenizer(llama3_tokenizer_model)


@pytest.fixture(scope="session")
def hf_smollm(default_gguf: Path) -> Any:
    """transformers' own conversion of the GGUF's tokenizer (the reference, where it applies)."""
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.AutoTokenizer.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name
    )


@pytest.fixture(scope="session")
def meta_llama3(
    tandem_home: Path, llama3_tokenizer_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """Meta's own `llama_models.llama3.tokenizer.Tokenizer`, from the wheel the file came in.

    Its module needs only tiktoken, so it is unpacked and imported as is: the reference is
    Meta's code, not our reading of it."""
    wheel = tandem_home / "wheels" / META_WHEEL
    if not wheel.is_file():
        pytest.skip(f"{META_WHEEL} is not in the cache; it carries Meta's reference tokenizer")
    root = tmp_path_factory.mktemp("meta")
    with zipfile.ZipFile(wheel) as zf:
        for member in META_MODULES:
            zf.extract(member, root)
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("llama_models.llama3.tokenizer")
    finally:
        sys.path.remove(str(root))
    return module.Tokenizer(llama3_tokenizer_model)


@pytest.fixture(scope="session")
def llama3_tokenizer_json(llama3_tokenizer_model: Path) -> dict[str, Any]:
    """LLaMA-3 as a tokenizer.json, converted by transformers from the same tiktoken file."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    converter = convert.TikTokenConverter(
        str(llama3_tokenizer_model),
        pattern=LLAMA3_PATTERN,
        additional_special_tokens=list(SPECIAL_TOKENS),
    )
    return json.loads(converter.converted().to_str())


@pytest.fixture(scope="session")
def spm_spec() -> dict[str, Any]:
    """A small LLaMA-2-style vocabulary: '▁' for spaces, <0xNN> byte fallback, stripping decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = [("▁", "h"), ("e", "l"), ("▁h", "el"), ("l", "o"), ("▁hel", "lo"), ("▁", "w")]
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d"] + ["".join(m) for m in merges]:
        vocab.setdefault(piece, len(vocab))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in vocab
            if t[0] == "<" and not t.startswith("<0x")
        ]
    )
    return json.loads(backend.to_str())
