"""Tokenizers of the engine: LLaMA-3 (tiktoken), GGUF byte-level BPE, tokenizer.json folders."""

from engine.tokenizer.base import Tokenizer
from engine.tokenizer.chat_template import ChatTemplate, Message, load_chat_template
from engine.tokenizer.detokenizer import Detokenizer
from engine.tokenizer.gguf_bpe import gguf_tokenizer
from engine.tokenizer.hf_folder import hf_folder_tokenizer
from engine.tokenizer.llama3 import Llama3Tokenizer
from engine.tokenizer.loader import load_tokenizer

__all__ = [
    "ChatTemplate",
    "Detokenizer",
    "Llama3Tokenizer",
    "Message",
    "Tokenizer",
    "gguf_tokenizer",
    "hf_folder_tokenizer",
    "load_chat_template",
    "load_tokenizer",
]
