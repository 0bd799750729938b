"""Attention over the paged KV cache, in plain PyTorch (CPU and CUDA).

The step's tokens are flattened into one (T,) row of queries. Per step, `AttentionMetadata` is
built once and reused by every layer: where each new token's K/V goes (`slot_mapping`), which
query rows are prefills (whole prompts, or chunks with earlier context in the pool), and which are
single-token decodes, batched together into one padded attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """Query rows [q_start, q_end) of one sequence whose first new token is at `start_pos`."""

    q_start: int
    q_end: int
    # Slots of all start_pos + q_len keys and the (q_len, ctx) causal mask with offset; both None
    # when start_pos == 0, since then the new K/V are the whole context.
    key_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # (B,) query rows of single-token decodes
    key_slots: torch.Tensor  # (B, max_ctx) pool slots of each sequence's keys, padded
    mask: torch.Tensor  # (B, 1, 1, max_ctx) bool: True where a key is real


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 pool slot of each new token
    prefills: list[PrefillSpan]
    decodes: DecodeGroup | None


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size


def build_metadata(
    starts: list[int],
    lengths: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """starts[i]: position of sequence i's first new token; lengths[i]: its number of new tokens."""
    slot_parts: list[torch.Tensor] = []
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
            slot_parts.append(torch.empty(0, dtype=torch.int64))  # filled in below
        else:
            table_t = torch.tensor(table, dtype=torch.int64)
            positions = torch.arange(ctx)
            seq_slots = _slots(table_t, positions, block_size)
            slot_parts.append(seq_slots[start:])
            if start == 0:
                prefills.append(PrefillSpan(row, row + length, None, None))
            else:
                mask = positions[None, :] <= positions[start:, None]  # (q_len, ctx)
                prefills.append(
                    PrefillSpan(row, row + length, seq_slots.to(device), mask.to(device))
                )
        row += length
    decodes = None
    if decode_idx:
        ctx_lens = torch.tensor([starts[i] + 1 for i in decode_idx])
        max_blocks = max(len(block_tables[i]) for i in decode_idx)
        tables = torch.zeros((len(decode_idx), max_blocks), dtype=torch.int64)
        for j, i in enumerate(decode_idx):
            tables[j, : len(block_tables[i])] = torch.tensor(block_tables[i])
        positions = torch.arange(int(ctx_lens.max()))
        key_slots = tables[:, positions // block_size] * block_size + positions % block_size
        valid = positions[None, :] < ctx_lens[:, None]  # (B, max_ctx)
        for j, i in enumerate(decode_idx):
            slot_parts[i] = key_slots[j, starts[i] : starts[i] + 1]
        decodes = DecodeGroup(
            rows=torch.tensor([row_of[i] for i in decode_idx], device=device),
            key_slots=key_slots.to(device),
            mask=valid.to(device)[:, None, None, :],
        )
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).to(device), prefills=prefills, decodes=decodes
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: (T, n_heads, hd); k, v: (T, n_kv, hd); pools: (slots, n_kv, hd). Returns (T, n_heads, hd).

    Writes the new K/V into the pools first, so chunks and decodes see their own tokens.
    """
    k_pool.index_copy_(0, meta.slot_mapping, k)
    v_pool.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for span in meta.prefills:
        qs = q[span.q_start : span.q_end].transpose(0, 1)  # (n_heads, q_len, hd)
        if span.key_slots is None:
            ks = k[span.q_start : span.q_end].transpose(0, 1)  # (n_kv, q_len, hd)
            vs = v[span.q_start : span.q_end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = k_pool.index_select(0, span.key_slots).transpose(0, 1)  # (n_kv, ctx, hd)
            vs = v_pool.index_select(0, span.key_slots).transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, enable_gqa=True)
        out[span.q_start : span.q_end] = o.transpose(0, 1)
    group = meta.decodes
    if group is not None:
        b, max_ctx = group.key_slots.shape
        flat = group.key_slots.reshape(-1)
        ks = k_pool.index_select(0, flat).view(b, max_ctx, *k_pool.shape[1:])  # (B, ctx, n_kv, hd)
        vs = v_pool.index_select(0, flat).view(b, max_ctx, *v_pool.shape[1:])
        qs = q.index_select(0, group.rows)[:, :, None, :]  # (B, n_heads, 1, hd)
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(1, 2), vs.transpose(1, 2), attn_mask=group.mask, enable_gqa=True
        )  # (B, n_heads, 1, hd)
        out.index_copy_(0, group.rows, o[:, :, 0, :])
    return out
