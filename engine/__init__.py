"""The model runtime: config, weights, tokenizers, paged-KV forward pass and sampling.

No gRPC, no processes, no shared memory: the services wrap this.
"""
