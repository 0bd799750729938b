"""GPT-2's byte-level alphabet: BPE vocabularies write every byte as one printable character."""

from __future__ import annotations

from functools import cache


@cache
def byte_to_char() -> dict[int, str]:
    # Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, NBSP, soft
    # hyphen) are shifted to U+0100 and up, so a token string never holds whitespace.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}


@cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def token_to_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token string stands for, or None if it is not in the alphabet."""
    table = char_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None
