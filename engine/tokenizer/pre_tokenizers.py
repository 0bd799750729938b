"""How text is cut into words before BPE merges, by its GGUF name (`tokenizer.ggml.pre`)."""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers
from tokenizers.pre_tokenizers import PreTokenizer

from engine.errors import ModelFormatError

# LLaMA-3's pattern, as Meta's llama_models/llama3/tokenizer.py writes it: contractions, letter
# runs with one leading non-letter, numbers of at most three digits, punctuation runs with their
# newlines, newline runs, then other whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (NeMo, Small 3.x, Devstral, Ministral 3), as mistral-common's vocabulary
# file gives it: letters with one leading non-letter (capitals, then lower case), each digit
# alone, punctuation runs with their newlines or slashes, newline runs, then other whitespace.
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> PreTokenizer:
    # ByteLevel's own regex is GPT-2's: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> PreTokenizer:
    # SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(use_regex)].
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM is the same: split off every \p{N} first, then
    # GPT-2's regex on what lies between. So "2024" is four words and " 7" is " " then "7".
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_by(pattern: str) -> PreTokenizer:
    """Words by a tiktoken-style pattern, then GPT-2's byte alphabet."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _llama3() -> PreTokenizer:
    return _split_by(LLAMA3_PATTERN)


def _tekken() -> PreTokenizer:
    return _split_by(TEKKEN_PATTERN)


# llama.cpp gives several names one rule; these groups follow its llama-vocab.cpp.
_BY_NAME = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
    "starcoder": _smollm,
    "refact": _smollm,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "tekken": _tekken,
}

# LLaMA-3 and Tekken look a whole word up in the vocabulary before merging (as tiktoken does);
# the GPT-2 family always merges.
_IGNORES_MERGES = {"llama-bpe", "llama3", "tekken"}


def pre_tokenizer_for(name: str) -> PreTokenizer:
    build = _BY_NAME.get(name)
    if build is None:
        known = ", ".join(sorted(_BY_NAME))
        raise ModelFormatError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={name!r} (supported: {known})"
        )
    return build()


def ignores_merges(name: str) -> bool:
    return name in _IGNORES_MERGES
