"""The tokenizer process: the public edge of the pipeline."""
