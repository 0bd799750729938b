"""The built-in texts: a token-stable vocabulary for sized prompts, and a few chat prompts."""

from __future__ import annotations

# Common English words that are each one token, with or without a leading space, in both the
# default model's byte-level BPE (SmolLM2) and LLaMA-3's tiktoken vocabulary: N of them joined
# by spaces are N tokens (plus BOS where the model adds one), so every server sees the same
# prompt length from the same text. tests/bench/test_bench_workload.py checks it.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if so "
    "no will more can its some other into out up them time only new these may two also first "
    "over like any after most such made many see used now people long way very work well just "
    "even because each back where through those much our how down then should world state "
    "years year water life still own great while last might must between here both under never "
    "same another day part high small being every without three against place found general "
    "house around until good end since number large different however little case point again "
    "public thought few system group"
)
WORDS = tuple(_WORDS.split())

# Short, varied requests, as a user of a chat model would send them.
CHAT_PROMPTS = (
    "Write a haiku about shared memory.",
    "Explain what a KV cache is to a new engineer, in three sentences.",
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for writing clear commit messages.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a short Python function that reverses a linked list.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "List five fruits that are high in vitamin C.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Suggest a name for a coffee shop run by robots.",
    "What are the pros and cons of working from home?",
    "Describe a sunset over the ocean in vivid detail.",
    "How do I make a simple tomato pasta sauce?",
    "Explain the difference between a process and a thread.",
    "Write a limerick about a cat who loves boxes.",
    "What should I pack for a weekend hiking trip?",
    "Give a one-paragraph history of the printing press.",
    "What is continuous batching in LLM serving?",
    "Write a friendly reminder email about a team meeting tomorrow.",
    "Compare trains and planes for a 500 km trip.",
)
