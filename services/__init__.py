"""The processes (tokenizer, scheduler, worker, launcher), the client and the CLI."""
