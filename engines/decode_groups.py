"""Decode attention on the CPU in small groups of sequences of the same (rounded) context length.

A decode row attends over its whole cached context. Padding every row to the longest context of
the batch (one gather, one batched matmul) wastes up to half the gather in a ShareGPT-like batch
(contexts from tens to a thousand tokens), and builds tens of MB of temporaries per layer whose
fresh pages the kernel must fault in. Measured on 2 AVX2 cores, 32 rows of 64..1000 tokens: one
padded group 720 ms of attention per step; groups of <= ~2k padded slots ~180 ms.

So every context is rounded up to a multiple of `ALIGN` slots (the tail masked) and the rows of
one rounded width form a group, cut so that rows x width stays under a budget: each group's K/V
stays in cache for the two matmuls that read it, padding is < ALIGN slots per row, and — since a
row is computed at the same width whatever else is in the batch — its attention output is
bit-identical alone or batched (so the int8 model's logits are batch-invariant).

Per layer the plan costs one gather of the queries and one scatter of the outputs for the whole
batch, then five ops per group: gather its K and V ([KV heads x rows, width, D], contiguous), scores
+ mask, softmax, weighted sum. (One gather of every group's K/V at once saves two ops per group but
was slower: the gathered data no longer stays in cache until its matmuls.) The plan is built once
per step on the host; every layer reuses it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_GROUP_SLOTS = 2048  # padded context slots per group: its K and V gathered ~1.5 MB each in fp32
ALIGN = 64  # contexts are padded to a multiple of this


@dataclass
class DecodeGroup:
    q_start: int  # first (row, head) pair of the group in the gathered queries
    pairs: int  # KV heads x rows
    kv_start: int  # first gathered K/V vector of the group
    width: int  # context slots per row (rounded)
    mask: torch.Tensor  # [pairs, 1, width] float: 0 on a real slot, -inf on padding


@dataclass
class DecodePlan:
    kv_index: torch.Tensor  # [sum pairs x width] int64 into a layer's K (or V) viewed as [KV heads x slots, D]
    pair_index: torch.Tensor  # [sum pairs] int64 into the queries / outputs viewed as [T x KV heads, group, D]
    groups: list[DecodeGroup]


def plan_decode(rows: np.ndarray, ctx_lens: np.ndarray, table: np.ndarray, kv_heads: int, num_slots: int,
                dtype: torch.dtype, device: torch.device, budget: int = DEFAULT_GROUP_SLOTS,
                align: int = ALIGN) -> DecodePlan:
    """rows[i]: the token row of decode sequence i; ctx_lens[i]: its context length; table[i]: its
    slots (at least ctx_lens[i] of them; the rest is ignored)."""
    widths = -(-ctx_lens // align) * align
    heads = np.arange(kv_heads, dtype=np.int64)
    kv_parts, pair_parts, groups = [], [], []
    q_start = kv_start = 0
    for width in np.unique(widths):
        width = int(width)
        members = np.flatnonzero(widths == width)
        per = max(1, budget // width)
        for s in range(0, len(members), per):
            m = members[s : s + per]
            valid = np.arange(width)[None, :] < ctx_lens[m][:, None]
            cols = min(width, table.shape[1])
            slots = np.zeros((len(m), width), dtype=np.int64)
            slots[:, :cols] = np.where(valid[:, :cols], table[m, :cols], 0)
            # head-major inside the group: [kv heads, rows, width] -> flat indices into [heads * slots]
            kv_parts.append((heads[:, None, None] * num_slots + slots[None]).reshape(-1))
            pair_parts.append((rows[m][None, :] * kv_heads + heads[:, None]).reshape(-1))
            mask = np.where(valid, 0.0, -np.inf).astype(np.float32)
            mask = np.broadcast_to(mask[None, :, None, :], (kv_heads, len(m), 1, width)).reshape(-1, 1, width)
            pairs = kv_heads * len(m)
            groups.append(DecodeGroup(q_start, pairs, kv_start, width,
                                      torch.from_numpy(np.require(mask, requirements=("C", "W"))).to(device=device, dtype=dtype)))
            q_start += pairs
            kv_start += pairs * width
    return DecodePlan(torch.from_numpy(np.concatenate(kv_parts)).to(device),
                      torch.from_numpy(np.concatenate(pair_parts)).to(device), groups)


def padded_plan(kv_slots: torch.Tensor, kv_valid: torch.Tensor, kv_heads: int, num_slots: int,
                dtype: torch.dtype) -> DecodePlan:
    """The whole batch as one group from padded tables [B, C] built by a caller (CUDA graphs): only
    device ops, so it can run inside a graph capture."""
    b, width = kv_slots.shape
    dev = kv_slots.device
    heads = torch.arange(kv_heads, device=dev)
    kv_index = (heads.view(-1, 1, 1) * num_slots + kv_slots.unsqueeze(0)).reshape(-1)
    pair_index = (torch.arange(b, device=dev).view(1, -1) * kv_heads + heads.view(-1, 1)).reshape(-1)
    valid = kv_valid.reshape(1, b, 1, width).expand(kv_heads, b, 1, width).reshape(kv_heads * b, 1, width)
    mask = torch.zeros(valid.shape, dtype=dtype, device=dev).masked_fill_(~valid, float("-inf"))
    return DecodePlan(kv_index, pair_index, [DecodeGroup(0, kv_heads * b, 0, width, mask)])
