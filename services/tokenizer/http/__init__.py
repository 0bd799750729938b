"""The OpenAI-compatible HTTP door of the tokenizer process, over the same admission as gRPC."""
