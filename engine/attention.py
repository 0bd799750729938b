"""Attention over the paged KV cache, in plain PyTorch (CPU and CUDA).

The step's tokens are flattened into one (T,) row of queries. Per step, `AttentionMetadata` is
built once and reused by every layer: where each new token's K/V goes (`slot_mapping`), which
query rows are prefills (whole prompts, or chunks with earlier context in the pool), and which are
single-token decodes, batched together into one padded attention call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.upload import to_device

if TYPE_CHECKING:  # imports Triton
    from engine.kernels.paged_decode import PagedDecode


@dataclass
class PrefillSpan:
    """Query rows [q_start, q_end) of one sequence whose first new token is at `start_pos`."""

    q_start: int
    q_end: int
    start_pos: int
    # Slots of all start_pos + q_len keys; None when start_pos == 0, since then the new K/V are
    # the whole context.
    key_slots: torch.Tensor | None
    _mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor | None:
        """The (q_len, ctx) causal mask with offset (None for a whole prompt), made on the device
        when a kernel first asks: the Triton prefill kernel needs none, and uploading one (MBs
        for a long chunk) would wait for the step before it to finish."""
        if self.key_slots is None:
            return None
        if self._mask is None:
            positions = torch.arange(len(self.key_slots), device=self.key_slots.device)
            self._mask = positions[None, :] <= positions[self.start_pos :, None]
        return self._mask


class DecodeGroup(Protocol):
    """Single-token decodes, attended together: `rows` are their query rows in the step."""

    rows: torch.Tensor  # (B,)

    def attend(self, q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """q: (B, n_heads, hd), one query per sequence → (B, n_heads, hd)."""
        ...


@dataclass
class GatherDecode:
    """Portable decode attention: gather every sequence's keys into a padded batch, then SDPA."""

    rows: torch.Tensor  # (B,)
    key_slots: torch.Tensor  # (B, max_ctx) pool slots of each sequence's keys, padded
    mask: torch.Tensor  # (B, 1, 1, max_ctx) bool: True where a key is real

    def attend(self, q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        b, max_ctx = self.key_slots.shape
        gathered = pool.index_select(0, self.key_slots.reshape(-1)).to(q.dtype)
        # gathered: (B * ctx, 2, n_kv, hd)
        gathered = gathered.view(b, max_ctx, *pool.shape[1:]).permute(2, 0, 3, 1, 4)
        # gathered: (2, B, n_kv, ctx, hd)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], gathered[0], gathered[1], attn_mask=self.mask, enable_gqa=True
        )  # (B, n_heads, 1, hd)
        return o[:, :, 0, :]


@dataclass
class KernelDecode:
    """Decode attention by a paged kernel reading the pool through block tables (CUDA)."""

    rows: torch.Tensor  # (B,)
    tables: torch.Tensor  # (B, max_blocks) int64 block ids
    context_lens: torch.Tensor  # (B,) int64
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # Set where a step of decodes alone hands attention its Q/K/V as the QKV product left them
    # (CUDA graphs): no RoPE + store launch before it.
    new_tokens: PagedDecode | None = None

    def attend(self, q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        return self.kernel(q, pool, self.tables, self.context_lens)


@dataclass
class RowwiseAttention:
    """Every row of a step with prompts attended by a kernel that computes each as a decode at
    its position would be (CPU): a row then comes out the same, bit for bit, whether its prompt
    ran whole, in chunks, or after a prefix found in the cache. (Attention over a block of rows
    at once, as SDPA does it, rounds differently with the block's rows; CPU's projections
    quantize activations per block of 32, which turns such last-bit differences into different
    greedy tokens.)"""

    tables: torch.Tensor  # (S, max_blocks) int64 block ids of each sequence
    starts: torch.Tensor  # (S,) int64 position of each sequence's first row
    lengths: torch.Tensor  # (S,) int64 its rows
    kernel: Callable[..., torch.Tensor]

    def attend(self, q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        return self.kernel(q, pool, self.tables, self.starts, self.lengths)


_NO_SLOTS = np.zeros(0, dtype=np.int64)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 pool slot of each new token
    prefills: list[PrefillSpan]
    decodes: DecodeGroup | None
    rowwise: RowwiseAttention | None = None  # where set, it attends every row of the step

    @property
    def fused_decodes(self) -> KernelDecode | None:
        """The decode group, where the step is decodes alone and their kernel rotates and stores
        the step's own tokens (the model then leaves Q/K/V as the product made them); else
        None."""
        group = self.decodes
        if self.prefills or not isinstance(group, KernelDecode) or group.new_tokens is None:
            return None
        return group


def build_metadata(
    starts: list[int],
    lengths: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    decode_kernel: Callable[..., torch.Tensor] | None = None,
    prefill_kernel: Callable[..., torch.Tensor] | None = None,
) -> AttentionMetadata:
    """starts[i]: position of sequence i's first new token; lengths[i]: its number of new tokens.
    prefill_kernel: where given, a step with prompts has all its rows attended by it
    (`RowwiseAttention`)."""
    # Built in numpy, not a tensor per sequence: a mixed step can carry hundreds of decodes.
    slot_parts: list[np.ndarray] = []
    prefills: list[PrefillSpan] = []
    decode_idx: list[int] = []
    row = 0
    row_of: list[int] = []
    for i, (start, length, table) in enumerate(zip(starts, lengths, block_tables, strict=True)):
        ctx = start + length
        if -(-ctx // block_size) > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} positions")
        row_of.append(row)
        if length == 1 and start > 0:
            decode_idx.append(i)
            slot_parts.append(_NO_SLOTS)  # filled in below
        else:
            positions = np.arange(ctx)
            seq_slots = np.asarray(table, dtype=np.int64)[positions // block_size] * block_size
            seq_slots += positions % block_size
            slot_parts.append(seq_slots[start:])
            context_slots = to_device(seq_slots, device) if start > 0 else None
            prefills.append(PrefillSpan(row, row + length, start, context_slots))
        row += length
    decodes: DecodeGroup | None = None
    if decode_idx:
        n = len(decode_idx)
        ctx_lens = np.fromiter((starts[i] + 1 for i in decode_idx), np.int64, n)
        lens = [len(block_tables[i]) for i in decode_idx]
        tables = np.zeros((n, max(lens)), dtype=np.int64)
        for j, i in enumerate(decode_idx):
            tables[j, : lens[j]] = block_tables[i]
        new_pos = ctx_lens - 1  # (B,) the position each decode writes
        new_slots = tables[np.arange(n), new_pos // block_size] * block_size + new_pos % block_size
        for j, i in enumerate(decode_idx):
            slot_parts[i] = new_slots[j : j + 1]
        rows = to_device([row_of[i] for i in decode_idx], device)
        if decode_kernel is not None:
            # The kernel walks the block tables itself: no per-key slots to build.
            decodes = KernelDecode(
                rows,
                to_device(tables, device),
                to_device(ctx_lens, device),
                decode_kernel,
            )
        else:
            positions = np.arange(int(ctx_lens.max()))
            key_slots = tables[:, positions // block_size] * block_size + positions % block_size
            valid = positions[None, :] < ctx_lens[:, None]  # (B, max_ctx)
            decodes = GatherDecode(
                rows,
                to_device(key_slots, device),
                to_device(valid, device)[:, None, None, :],
            )
    slot_mapping = to_device(np.concatenate(slot_parts), device)
    rowwise = None
    if prefills and prefill_kernel is not None:
        tables = np.zeros((len(block_tables), max(map(len, block_tables))), dtype=np.int64)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        rowwise = RowwiseAttention(
            to_device(tables, device), to_device(starts, device), to_device(lengths, device),
            prefill_kernel,
        )  # fmt: skip
    return AttentionMetadata(slot_mapping, prefills, decodes, rowwise)


# cuDNN's attention builds an execution plan on the host for each new shape of queries and keys,
# which every new length of prefill chunk paid for (bench/RESULTS-gpu.md); these build nothing.
_FLASH = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # math: where flash cannot run
_PORTABLE = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q: (n_heads, q_len, hd); k, v: (n_kv, ctx, hd); causal when there is no mask."""
    # Fused kernels (flash, memory-efficient) want 4-D inputs; 3-D ones fall back to the math
    # path, which on CUDA also upcasts to fp32 and materialises the scores.
    q, k, v = q[None], k[None], v[None]  # (1, heads, len, hd)
    mask4 = None if mask is None else mask[None, None]
    if not q.is_cuda:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask4, is_causal=mask is None, enable_gqa=True
        )
    elif mask is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
        with sdpa_kernel(_FLASH):  # flash attention reads GQA's shared heads as they are
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        # The other kernels take GQA only as repeated heads.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        with sdpa_kernel(_PORTABLE):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask4, is_causal=mask is None)
    return out[0]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (T, n_heads, hd); k, v: (T, n_kv, hd) of this step, already in the pool
    (slots, 2, n_kv, hd) so that chunks and decodes see their own tokens. Returns (T, n_heads, hd),
    in `out` if given.
    """
    if meta.rowwise is not None:
        heads = meta.rowwise.attend(q, pool)
        return heads if out is None else out.copy_(heads)
    group = meta.decodes
    if group is not None and not meta.prefills:
        heads = group.attend(q, pool)  # the common step: decodes only, no scatter back
        return heads if out is None else out.copy_(heads)
    out = torch.empty_like(q) if out is None else out
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_end)
        if span.key_slots is None:  # a whole prompt: its keys are this step's
            keys, values = k[rows], v[rows]  # (q_len, n_kv, hd)
        else:
            seq_kv = pool.index_select(0, span.key_slots).to(q.dtype)  # (ctx, 2, n_kv, hd)
            keys, values = seq_kv[:, 0], seq_kv[:, 1]
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            from engine.kernels import prefill_attention as kernel

            if kernel.fits(q):  # causal over the sequence's keys, as span.mask says
                kernel.prefill_attention(q[rows], keys, values, out=out[rows])
                continue
        qs, keys, values = (t.transpose(0, 1) for t in (q[rows], keys, values))  # heads first
        out[rows] = _prefill(qs, keys, values, span.mask()).transpose(0, 1)
    if group is not None:
        out.index_copy_(0, group.rows, group.attend(q.index_select(0, group.rows), pool))
    return out
