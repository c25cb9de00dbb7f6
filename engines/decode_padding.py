"""Fixed shapes for decode steps that run as CUDA graphs: batch buckets, and the packed inputs that
every graph reads.

A CUDA graph replays exactly the kernels it captured, on the same addresses and shapes. With paged
attention (`engines.model.paged_attention`) a decode step's shapes depend on its batch alone — each
row's page table has one fixed width, the most pages a sequence can own — so a graph is captured per
*batch bucket* and serves every context length. A step is padded up to its bucket: an extra row
decodes token 0 at position 0 of a scratch page no request owns (the worker reserves it), context
length 1, so its K/V write lands in the scratch slot and its attention reads only that slot; its
logits are computed and dropped.

Batch buckets follow SGLang's spacing (powers of two, then steps of 8, 16, 32); `thin_buckets`
keeps fewer when the graphs would not fit their budget.

`DecodeInputs` packs the inputs of a step — token ids, positions, new-K/V slots, context lengths,
page tables — into one int32 buffer on the device, shared by every graph (replays never overlap),
with a host twin (pinned on CUDA): a step is one host-to-device copy, and only of the pages its
rows use, because the page tables are stored column by column (`[width, rows]`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

_ALIGN = 16  # rows per segment are padded to 16 int32s: every segment starts 64-byte aligned


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


def thin_buckets(buckets: Sequence[int], keep: int) -> tuple[int, ...]:
    """`keep` of the sorted `buckets`, evenly spread over the list and always with the largest (so
    every batch still has a bucket, padded further)."""
    if keep < 1:
        raise ValueError(f"keep at least one bucket, got {keep}")
    buckets = tuple(sorted(buckets))
    if keep >= len(buckets):
        return buckets
    if keep == 1:
        return buckets[-1:]
    last = len(buckets) - 1
    return tuple(sorted({buckets[round(i * last / (keep - 1))] for i in range(keep)}))


@dataclass(frozen=True)
class DecodeShape:
    batch: int    # padded rows: the bucket
    context: int  # tokens a row's page table can hold (the same for every bucket)


class DecodeInputs:
    """The inputs of padded decode steps of up to `max_batch` rows in one int32 buffer: four segments
    of `rows` values (token ids, positions, new-K/V slots, context lengths), then the page tables
    as `[width, rows]` — column r is row r's pages. A step of `batch` rows reads the first `batch`
    values of each segment and the first `batch` columns."""

    def __init__(self, max_batch: int, width: int, page_size: int, scratch_slot: int, num_slots: int,
                 device: torch.device | str):
        if num_slots >= 2**31:
            raise ValueError(f"{num_slots} KV slots do not fit the int32 tables")
        self.max_batch, self.width, self.page_size = max_batch, width, page_size
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_slot // page_size
        self.rows = -(-max_batch // _ALIGN) * _ALIGN
        size = self.rows * (4 + width)
        dev = torch.device(device)
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=dev)
        # Pageable, not pinned: an asynchronous copy from pageable memory is staged before the call
        # returns, so the host twin can be rewritten at once. A pinned block instead records an event
        # on every stream it was copied on when it is freed, and a green context's stream whose context
        # is already destroyed makes that free abort the process (H200, driver 13.0, 2026-11-26: the
        # profiler and a bullet server died at start-up). The copy is a few KiB per step.
        self.host_buf = torch.zeros(size, dtype=torch.int32)
        self._host = self.host_buf.numpy()

    def _segments(self, batch: int):
        r, h = self.rows, self._host
        return h[:batch], h[r : r + batch], h[2 * r : 2 * r + batch], h[3 * r : 3 * r + batch], \
            h[4 * r :].reshape(self.width, r)

    def fill(self, token_ids: Sequence[int], starts: Sequence[int], page_tables: Sequence[Sequence[int]],
             batch: int) -> int:
        """Write the host twin for decoding `token_ids[i]` after `starts[i]` cached tokens of row i, rows
        `len(token_ids)` .. `batch` padding. Returns how many values `upload` must copy. Raises
        ValueError when the rows do not fit `batch` or a page table is too short or too long."""
        real = len(token_ids)
        if not 0 < real <= batch <= self.max_batch or len(starts) != real or len(page_tables) != real:
            raise ValueError(f"{real} rows do not fit a batch of {batch} (at most {self.max_batch})")
        ps = self.page_size
        ids, positions, slots, lens, pages = self._segments(batch)
        start = np.asarray(starts, dtype=np.int64)
        need = start // ps + 1  # pages holding positions 0 .. start
        used = int(need.max())
        if used > self.width:
            raise ValueError(f"a row needs {used} pages, the tables hold {self.width}")
        for i, (table, n) in enumerate(zip(page_tables, need.tolist())):
            if len(table) < n:
                raise ValueError(f"page table of row {i} covers {len(table) * ps} tokens, needs {starts[i] + 1}")
            pages[:n, i] = table[:n]
        ids[:real], ids[real:] = token_ids, 0
        positions[:real], positions[real:] = start, 0
        slots[:real] = pages[need - 1, np.arange(real)].astype(np.int64) * ps + start % ps
        slots[real:] = self.scratch_slot
        lens[:real], lens[real:] = start + 1, 1
        pages[0, real:batch] = self.scratch_page  # stale pages of an earlier step must never be a padding row's
        return self.rows * (4 + used)

    def fill_padding(self, batch: int) -> int:
        """Every row padding (what a capture runs on: it writes only the scratch slot)."""
        if not 0 < batch <= self.max_batch:
            raise ValueError(f"a batch of {batch} rows does not fit {self.max_batch}")
        ids, positions, slots, lens, pages = self._segments(batch)
        ids[:], positions[:], slots[:], lens[:] = 0, 0, self.scratch_slot, 1
        pages[0, :batch] = self.scratch_page
        return self.rows * 5

    def upload(self, count: int) -> None:
        """Copy the first `count` values to the device, on the current stream (before the replay that
        reads them)."""
        dst, src = self.device_buf[:count], self.host_buf[:count]
        if self.device_buf.device.type != "cuda":
            dst.copy_(src)
            return
        dst.copy_(src, non_blocking=True)  # no stream sync; the source is staged before it returns

    def views(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Device views for a `batch`-row step: ids, positions, slots, context lengths [batch] and the
        page tables [width, batch] (column-major: transpose for `PagedTables`)."""
        r, d = self.rows, self.device_buf
        return d[:batch], d[r : r + batch], d[2 * r : 2 * r + batch], d[3 * r : 3 * r + batch], \
            d[4 * r :].view(self.width, r)[:, :batch]
