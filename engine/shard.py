"""What each tensor-parallel rank holds of the model: a plan, and the loader's weights seen
through it.

Megatron's split, as vLLM, SGLang and gpt-fast make it:

- column-parallel (a slice of the output rows): Q, K and V by heads, gate and up by rows of the
  intermediate; each rank's slice of the activations stays on it;
- row-parallel (a slice of the input columns): O by the query heads' columns, down by the
  intermediate's; each rank's output is a partial sum, all-reduced (parallel_layers.py);
- vocabulary-parallel: the embedding's and the head's rows by token id, each rank's slice padded
  to one length (`vocab_rows`), so that gathering the logits takes equal pieces;
- the norms whole on every rank.

Heads split by KV head: a rank takes whole GQA groups (its KV heads and the query heads that read
them), so the KV pool splits by KV heads too and attention needs no communication. Where the KV
heads do not divide evenly (SmolLM2-135M: 3 over 2 ranks) the ranks hold 2 and 1: uneven, but
exact. A rank without a KV head cannot be, so more ranks than KV heads are refused.

The intermediate splits on multiples of 32 where it can, GGUF's block: a row-parallel slice of
4- or 8-bit GGUF codes must start and end on a block, and then the codes split as they are.
Where one cannot (a slice inside a block), that weight is dequantized and split as floats.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequest
from engine.quant import GROUP, Q4Blocks
from engine.weights import WeightSource

ROW_ALIGN = 16  # padded vocabulary rows: whole row groups for the int4 and native-code kernels

# Per HF weight name part: which axis a rank slices ("rows": outputs, "cols": inputs) and along
# which of the plan's ranges, in rows or columns of the weight.
_SPLITS = {
    "q_proj": ("rows", "q"),
    "k_proj": ("rows", "kv"),
    "v_proj": ("rows", "kv"),
    "o_proj": ("cols", "q"),
    "gate_proj": ("rows", "ffn"),
    "up_proj": ("rows", "ffn"),
    "down_proj": ("cols", "ffn"),
    "embed_tokens": ("rows", "vocab"),
    "lm_head": ("rows", "vocab"),
}


def _split(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of part `index` of `total`, cut in whole `unit`s as evenly as they go."""
    units = total // unit
    return index * units // parts * unit, (index + 1) * units // parts * unit


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    kv_heads: tuple[int, int]  # [start, end) of the KV heads this rank attends with
    q_heads: tuple[int, int]  # the query heads of those KV heads' groups
    ffn: tuple[int, int]  # its rows of gate and up, columns of down
    vocab: tuple[int, int]  # the token ids it embeds and scores
    vocab_rows: int  # rows every rank holds of the embedding and the head (padding at the end)
    head_dim: int

    @classmethod
    def for_model(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        name = config.name or "the model"
        if world_size > config.n_kv_heads:
            raise InvalidRequest(
                "tensor_parallel_size",
                f"{name} has {config.n_kv_heads} KV heads ({config.n_heads} query heads): a "
                f"rank needs at least one, so at most {config.n_kv_heads} ranks, not {world_size}",
            )
        kv = _split(config.n_kv_heads, world_size, rank)
        group = config.n_heads // config.n_kv_heads
        unit = GROUP if config.ffn_dim % GROUP == 0 and config.ffn_dim >= GROUP * world_size else 1
        rows = -(-config.vocab_size // world_size)
        rows = -(-rows // ROW_ALIGN) * ROW_ALIGN
        v = config.vocab_size
        return cls(
            rank=rank,
            world_size=world_size,
            kv_heads=kv,
            q_heads=(kv[0] * group, kv[1] * group),
            ffn=_split(config.ffn_dim, world_size, rank, unit),
            vocab=(min(rank * rows, v), min((rank + 1) * rows, v)),
            vocab_rows=rows,
            head_dim=config.head_dim,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model this rank computes: its heads, its intermediate, its vocabulary rows."""
        return replace(
            config,
            n_heads=self.q_heads[1] - self.q_heads[0],
            n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            ffn_dim=self.ffn[1] - self.ffn[0],
            vocab_size=self.vocab_rows,
            head_dim=config.head_dim,
        )

    def span(self, name: str) -> tuple[str, int, int, int] | None:
        """(axis, start, end, padding rows) of HF weight `name` this rank holds; None: all of it."""
        split = _SPLITS.get(name.split(".")[-2])
        if split is None:
            return None
        axis, kind = split
        hd = self.head_dim
        start, end = {
            "q": (self.q_heads[0] * hd, self.q_heads[1] * hd),
            "kv": (self.kv_heads[0] * hd, self.kv_heads[1] * hd),
            "ffn": self.ffn,
            "vocab": self.vocab,
        }[kind]
        return axis, start, end, (self.vocab_rows - (end - start) if kind == "vocab" else 0)


class ShardedSource:
    """A WeightSource (weights.py) yielding this rank's slice of each weight of another."""

    def __init__(self, source: WeightSource, plan: ShardPlan) -> None:
        self.source, self.plan = source, plan

    @property
    def native_codes(self) -> bool:
        return self.source.native_codes

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str) -> torch.Tensor:
        tensor = self.source.get(name)
        span = self.plan.span(name)
        if span is None:
            return tensor
        axis, start, end, padding = span
        if axis == "cols":
            return tensor[:, start:end].contiguous()
        rows = tensor[start:end].contiguous()
        return torch.cat([rows, rows.new_zeros((padding, *rows.shape[1:]))]) if padding else rows

    def get_int4(self, name: str) -> list[Q4Blocks] | None:
        parts = self.source.get_int4(name)
        span = self.plan.span(name)
        if parts is None or span is None:
            return parts
        axis, start, end, padding = span
        if axis == "cols":
            if start % GROUP or end % GROUP:
                return None  # inside a block: dequantized and split as floats instead
            g0, g1 = start // GROUP, end // GROUP
            return [Q4Blocks(p.codes[:, start:end], p.scales[:, g0:g1], p.zeros[:, g0:g1])
                    for p in parts]  # fmt: skip
        return [_pad_codes(p.rows(torch.arange(start, end)), padding) for p in parts]


def _pad_codes(blocks: Q4Blocks, padding: int) -> Q4Blocks:
    """`blocks` followed by `padding` rows of zero weights."""
    if not padding:
        return blocks
    k = blocks.shape[1]
    pad = Q4Blocks(
        torch.full((padding, k), 8, dtype=blocks.codes.dtype),  # (8 - 8) * 0 + 0: zero
        blocks.scales.new_zeros((padding, k // GROUP)),
        blocks.zeros.new_zeros((padding, k // GROUP)),
    )
    return Q4Blocks.cat([blocks, pad])
