"""The worker process: owns the engine and the KV memory, and runs steps."""
