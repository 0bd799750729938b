"""A Hugging Face tokenizer folder: `tokenizer.json`, with `tokenizer_config.json` for the rest."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from engine.errors import ModelFormatError, ModelNotFound
from engine.tokenizer.byte_level import token_to_bytes
from engine.tokenizer.chat_template import ChatTemplate
from engine.tokenizer.hf_backed import HFBackedTokenizer

_SPECIAL_TEXT_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFormatError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as its text or as an AddedToken object.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> ChatTemplate | None:
    # Newer transformers save the template beside the config, and that file wins.
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is for plain chat.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return ChatTemplate(template) if isinstance(template, str) else None


def _decoder_steps(decoder: Any) -> list[dict[str, Any]]:
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _decoder_steps(d)]
    return [decoder]


def _spm_piece(token: str) -> bytes:
    # SentencePiece vocabularies write a space as U+2581 and unknown bytes as <0xNN> tokens.
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode()


def _pieces(
    backend: tokenizers.Tokenizer, decoder: Any, added: dict[int, str], source: str
) -> tuple[list[bytes], bool]:
    steps = _decoder_steps(decoder)
    as_bytes: Callable[[str], bytes | None]
    kinds = {s.get("type") for s in steps}
    if "ByteLevel" in kinds:
        as_bytes = token_to_bytes
        strips = False
    elif "Metaspace" in kinds or any(
        s.get("type") == "Replace" and s.get("content") == " " for s in steps
    ):
        as_bytes = _spm_piece
        strips = any(
            (s.get("type") == "Strip" and s.get("content") == " " and s.get("start", 0) > 0)
            or (s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never")
            for s in steps
        )
    else:
        raise ModelFormatError(
            f"{source}: decoder {sorted(k for k in kinds if k)} is not supported "
            "(byte-level BPE and SentencePiece-style vocabularies are)"
        )
    pieces = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        if i in added:
            pieces.append(added[i].encode())
            continue
        token = backend.id_to_token(i)
        if token is None:  # a hole in the ids: never produced, decodes to nothing
            pieces.append(b"")
            continue
        raw = as_bytes(token)
        pieces.append(token.encode() if raw is None else raw)
    return pieces, strips


def hf_folder_tokenizer(folder: Path) -> HFBackedTokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelNotFound(f"no tokenizer.json in {folder}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as err:  # the library raises plain Exception for a bad file
        raise ModelFormatError(f"{tokenizer_file} is not a readable tokenizer: {err}") from err
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")

    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    # The decoder says how token strings map to bytes; read it alone, not the whole file's JSON.
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder else None
    pieces, strips = _pieces(backend, decoder, added, str(tokenizer_file))

    def token_id(field: str) -> int | None:
        content = _token_text(config.get(field))
        return None if content is None else backend.token_to_id(content)

    bos = token_id("bos_token")
    stops = {i for i in [token_id("eos_token")] if i is not None}
    extra = generation.get("eos_token_id")
    stops.update(i for i in (extra if isinstance(extra, list) else [extra]) if isinstance(i, int))
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # No explicit word: the post-processor decides, as it does for transformers.
        ids = backend.encode("", add_special_tokens=True).ids
        add_bos = bos is not None and ids[:1] == [bos]
    special_text = {f: t for f in _SPECIAL_TEXT_FIELDS if (t := _token_text(config.get(f)))}
    return HFBackedTokenizer(
        backend=backend,
        pieces=pieces,
        special_ids=frozenset(special_ids),
        bos_token_id=bos,
        eos_token_ids=frozenset(stops),
        add_bos=add_bos and bos is not None,
        chat_template=_chat_template(folder, config),
        special_token_text=special_text,
        strips_leading_space=strips,
    )
