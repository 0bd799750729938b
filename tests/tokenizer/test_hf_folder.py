"""tokenizer.json folders: LLaMA-3 as transformers converts it, and a SentencePiece-style one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import processors

from engine.errors import ModelFormatError
from engine.tokenizer import Detokenizer, Tokenizer, hf_folder_tokenizer
from engine.tokenizer.llama3 import CHAT_TEMPLATE

TEXTS = [
    "Hello, world! It's 2024-11-30.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "naïve 日本語 😀👍🏽 ½",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
]


def write_folder(folder: Path, tokenizer_json: dict[str, Any], **files: dict[str, Any]) -> Path:
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def llama3_folder(
    llama3_tokenizer_json: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    spec = dict(llama3_tokenizer_json)
    # As in Meta-Llama-3's tokenizer.json: BOS comes from the post-processor, not the config.
    spec["post_processor"] = json.loads(
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 128000)]
        ).__getstate__()
    )
    return write_folder(
        tmp_path_factory.mktemp("hf") / "llama3",
        spec,
        tokenizer_config={
            "bos_token": "<|begin_of_text|>",
            "eos_token": {"content": "<|eot_id|>", "special": True},
            "chat_template": CHAT_TEMPLATE,
        },
        generation_config={"eos_token_id": [128001, 128008, 128009]},
    )


def test_llama3_folder_equals_the_tiktoken_tokenizer(
    llama3_folder: Path, llama3: Tokenizer
) -> None:
    folder = hf_folder_tokenizer(llama3_folder)
    assert folder.vocab_size == llama3.vocab_size
    assert folder.bos_token_id == 128000
    assert folder.add_bos  # from the post-processor
    assert folder.eos_token_ids == llama3.eos_token_ids
    assert folder.is_special(128009) and not folder.is_special(1000)
    for text in TEXTS:
        for allow_special in (True, False):
            ids = folder.encode(text, allow_special=allow_special)
            assert ids == llama3.encode(text, allow_special=allow_special)
            assert folder.decode(ids) == text
    for token_id in (0, 198, 128000, 128255, 100000):
        assert folder.token_bytes(token_id) == llama3.token_bytes(token_id)
    messages = [{"role": "user", "content": "Hi"}]
    assert folder.apply_chat_template(messages) == llama3.apply_chat_template(messages)


def test_add_bos_from_post_processor_unless_config_says(
    spm_spec: dict[str, Any], tmp_path: Path
) -> None:
    spec = dict(spm_spec)
    spec["post_processor"] = json.loads(
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]).__getstate__()
    )
    inferred = write_folder(tmp_path / "inferred", spec, tokenizer_config={"bos_token": "<s>"})
    assert hf_folder_tokenizer(inferred).add_bos
    told = write_folder(
        tmp_path / "told", spec, tokenizer_config={"bos_token": "<s>", "add_bos_token": False}
    )
    assert not hf_folder_tokenizer(told).add_bos
    assert hf_folder_tokenizer(told).chat_template is None


def test_chat_template_jinja_file_and_named_templates(
    spm_spec: dict[str, Any], tmp_path: Path
) -> None:
    named = write_folder(
        tmp_path / "named",
        spm_spec,
        tokenizer_config={
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ messages[0]['content'] }}!"},
            ]
        },
    )
    messages = [{"role": "user", "content": "Hi"}]
    assert hf_folder_tokenizer(named).apply_chat_template(messages) == "Hi!"
    (named / "chat_template.jinja").write_text("[{{ messages[0]['role'] }}]")
    assert hf_folder_tokenizer(named).apply_chat_template(messages) == "[user]"


def test_sentencepiece_style_folder(spm_spec: dict[str, Any], tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path / "spm",
        spm_spec,
        tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
    )
    tokenizer = hf_folder_tokenizer(folder)
    library = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    library.encode_special_tokens = True  # as allow_special=False
    assert tokenizer.strips_leading_space
    assert tokenizer.add_bos and tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    for text in ["hello world", "hello  héllo wörld 😀", " leading", "</s> as text"]:
        ids = tokenizer.encode_prompt(text, allow_special=False)
        assert ids[0] == 1
        assert ids[1:] == library.encode(text, add_special_tokens=False).ids
        for skip in (True, False):
            expected = library.decode(ids, skip_special_tokens=skip)
            assert tokenizer.decode(ids, skip_special=skip) == expected
            detok = Detokenizer(tokenizer, skip_special=skip)
            assert "".join([detok.feed(i) for i in ids] + [detok.flush()]) == expected
        assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.token_bytes(3 + 0xC3) == b"\xc3"
    assert tokenizer.token_bytes(tokenizer.encode("hello", allow_special=False)[0]) == b" hello"


def test_unreadable_or_unsupported_folders(spm_spec: dict[str, Any], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not a readable tokenizer"):
        hf_folder_tokenizer(bad)
    wordpiece = dict(spm_spec, decoder={"type": "WordPiece", "prefix": "##", "cleanup": True})
    with pytest.raises(ModelFormatError, match="WordPiece"):
        hf_folder_tokenizer(write_folder(tmp_path / "wp", wordpiece))
    broken_config = write_folder(tmp_path / "cfg", spm_spec)
    (broken_config / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json"):
        hf_folder_tokenizer(broken_config)
