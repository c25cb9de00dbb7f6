"""Fixed shapes for decode steps that run as CUDA graphs: bucket sizes and padded input tables.

A CUDA graph replays exactly the kernels it captured, on the same addresses and shapes. A decode
step's shape is (batch, longest context), so graphs are captured per *bucket* of both, and a step
is padded up to its bucket:

* **batch**: extra rows decode a dummy token at position 0 whose K/V go to `scratch_slot`, a slot
  no request owns (the worker reserves a page for it), so padding never overwrites a request's KV.
  Their logits are computed and dropped.
* **context**: the slot table of every row is padded with slot 0 and masked out (`kv_valid` False),
  exactly as the eager step pads shorter rows up to the longest one.

Buckets trade padding for the number of graphs: batch buckets follow SGLang's spacing (powers of
two, then steps of 8 and 16); context buckets are multiples of `step` up to 8 steps, then grow by
half (so at most a third of a long context's gather is padding)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_CONTEXT_STEP = 256


def default_batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond; the last bucket is
    `max_batch` itself so the largest batch the scheduler may form still has a graph."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, b = [], 1
    while b <= max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


def batch_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `batch` rows, None when the batch is larger than every bucket."""
    if batch < 1:
        raise ValueError(f"a decode batch has at least one row, got {batch}")
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


def context_bucket(context: int, step: int = DEFAULT_CONTEXT_STEP) -> int:
    """The padded context length for a step whose longest row has `context` tokens."""
    if context < 1 or step < 1:
        raise ValueError(f"context and step must be >= 1, got {context}, {step}")
    if context <= 8 * step:
        return -(-context // step) * step
    size = 8 * step
    while size < context:
        size += max(step, size // 2 // step * step)
    return size


@dataclass(frozen=True)
class DecodeShape:
    batch: int    # padded rows
    context: int  # padded slot-table width

    @property
    def slots(self) -> int:
        return self.batch * self.context


@dataclass
class PaddedDecode:
    """Host-side inputs of one padded decode step; rows [0, real) are the requests."""

    real: int
    token_ids: np.ndarray     # [batch] int64
    positions: np.ndarray     # [batch] int64
    slot_mapping: np.ndarray  # [batch] int64: where each row's new K/V go
    kv_slots: np.ndarray      # [batch, context] int64: each row's context, in order
    kv_valid: np.ndarray      # [batch, context] bool


def pad_decode(token_ids: Sequence[int], starts: Sequence[int], page_tables: Sequence[Sequence[int]],
               shape: DecodeShape, page_size: int, scratch_slot: int) -> PaddedDecode:
    """Tables for decoding `token_ids[i]` after `starts[i]` cached tokens of request i, padded to
    `shape`. Raises ValueError if the requests do not fit the shape or a page table is too short."""
    real = len(token_ids)
    if not 0 < real <= shape.batch or len(starts) != real or len(page_tables) != real:
        raise ValueError(f"{real} rows do not fit a batch of {shape.batch}")
    ids = np.zeros(shape.batch, dtype=np.int64)
    positions = np.zeros(shape.batch, dtype=np.int64)
    slot_mapping = np.full(shape.batch, scratch_slot, dtype=np.int64)
    kv_slots = np.zeros((shape.batch, shape.context), dtype=np.int64)
    kv_valid = np.zeros((shape.batch, shape.context), dtype=bool)
    for i, (token, start, table) in enumerate(zip(token_ids, starts, page_tables)):
        length = start + 1
        if length > shape.context:
            raise ValueError(f"row {i} has {length} tokens, more than the bucket's {shape.context}")
        if len(table) * page_size < length:
            raise ValueError(f"page table of row {i} covers {len(table) * page_size} tokens, needs {length}")
        pos = np.arange(length, dtype=np.int64)
        pages = np.asarray(table, dtype=np.int64)
        kv_slots[i, :length] = pages[pos // page_size] * page_size + pos % page_size
        kv_valid[i, :length] = True
        ids[i], positions[i], slot_mapping[i] = token, start, kv_slots[i, start]
    # padding rows attend to their own dummy K/V in the scratch slot: one valid key keeps their
    # softmax finite (all -inf would make NaNs, harmless but noisy in a debugger)
    kv_slots[real:, 0] = scratch_slot
    kv_valid[real:, 0] = True
    return PaddedDecode(real, ids, positions, slot_mapping, kv_slots, kv_valid)
