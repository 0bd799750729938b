"""The model's layers that talk to the other ranks, swapped in around a sharded model's own.

model.py computes what one rank holds (its heads, its slice of the intermediate and of the
vocabulary: engine/shard.py) and never calls a collective; `parallelize` wraps the four places
where a rank needs the others: the embedding (each token's row lives on one rank), O and down
(each rank's output is a partial sum over its inputs), and the head (each rank scores its slice
of the vocabulary; the logits are gathered whole, so sampling is exactly as on one rank). These
wrap whatever the loader put there (nn.Linear, int8, GGUF codes, packed), which never knows.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model import Transformer
from engine.tensor_parallel import TensorParallel


class RowParallel(nn.Module):
    """A projection over this rank's slice of the input features: partial sums, all-reduced."""

    def __init__(self, inner: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table, [start, start + rows) of the vocabulary."""

    def __init__(self, inner: nn.Embedding, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.inner, self.start, self.tp = inner, start, tp
        self.rows = inner.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # (T,)
        mine = (local >= 0) & (local < self.rows)
        # Every rank looks up a row; those of other ranks' tokens count zero in the sum.
        x = self.inner(local.clamp(0, self.rows - 1)) * mine[:, None].to(self.inner.weight.dtype)
        return self.tp.all_reduce(x)  # (T, dim)


class VocabParallelHead(nn.Module):
    """This rank's rows of the output head: its slice of the logits, gathered whole."""

    def __init__(self, inner: nn.Module, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.tp = inner, vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.inner(hidden))  # (N, world_size * rows)
        return logits[:, : self.vocab_size].contiguous()  # the padding rows dropped


def parallelize(model: Transformer, tp: TensorParallel, vocab_start: int, vocab_size: int) -> None:
    """Wrap a rank's model (its weights already sliced) in the collectives above, in place."""
    for block in model.blocks():
        for owner, name in ((block.attention, "wo"), (block.feed_forward, "w2")):
            setattr(owner, name, RowParallel(getattr(owner, name), tp))
    swaps = {
        "tok_embeddings": VocabParallelEmbedding(model.tok_embeddings, vocab_start, tp),
        "output": VocabParallelHead(model.output, vocab_size, tp),
    }
    for name, module in swaps.items():
        setattr(model, name, module)
