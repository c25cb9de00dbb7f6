"""Grid sizes (thread blocks) of the kernels of a Llama layer, from the tile shapes kernels use.

These tile shapes reproduce Bullet Table 2 exactly (QKV, Attn, O columns) with one thread block per
SM, see `estimator.waves`:
* GEMM (QKV, O, gate/up, down, LM head): output tiles of 128 rows (tokens) x 256 columns (features),
  grid = ceil(M/128) * ceil(N/256) — the CUTLASS/cuBLAS "128x256" Ampere bf16 tile.
* Prefill attention (FlashAttention-2 forward): one block per (128-query tile, query head),
  grid = sum over sequences of ceil(s/128) * heads.

A real GEMM library picks its tile per problem: for short inputs it falls back on smaller tiles so
that the grid fills the device. `HeuristicTiling` imitates that choice (the one that minimises waves
x tile area on the *whole* device: libraries do not know a stream has been restricted to fewer SMs,
so the tile is chosen for all N units and the waves are then counted on the N_p units granted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

# Decode attention (FlashInfer-style split-KV): one block per (request, KV head, chunk of the context).
DECODE_KV_CHUNK = 512
ATTN_QUERY_TILE = 128
TABLE2_GEMM_TILE = (128, 256)
# Candidate output tiles (rows x cols) of a tensor-core GEMM library on Ampere/Hopper, largest first.
CANDIDATE_GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 128), (64, 64))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gemm_grid(rows: int, cols: int, tile: tuple[int, int]) -> int:
    return ceil_div(rows, tile[0]) * ceil_div(cols, tile[1])


def prefill_attention_grid(seq_lens, heads: int, query_tile: int = ATTN_QUERY_TILE) -> int:
    return heads * sum(ceil_div(s, query_tile) for s in seq_lens)


def decode_attention_grid(batch: int, sum_ctx: int, kv_heads: int, chunk: int = DECODE_KV_CHUNK) -> int:
    """Blocks of a split-KV decode kernel. From the (batch, total context) summary the per-request
    ceil() is approximated by its mean (each request's last chunk is half full on average)."""
    return kv_heads * max(batch, round(sum_ctx / chunk + batch / 2))


@dataclass(frozen=True)
class FixedTiling:
    """Every GEMM uses the same tile (the Table 2 model)."""

    tile: tuple[int, int] = TABLE2_GEMM_TILE

    def gemm_tile(self, rows: int, cols: int) -> tuple[int, int]:
        return self.tile


@dataclass(frozen=True)
class HeuristicTiling:
    """Pick, per GEMM shape, the tile with the fewest waves x tile area on the full device; ties go
    to the larger tile (better data reuse), as library heuristics do."""

    device_units: int
    blocks_per_unit: int = 1
    candidates: tuple[tuple[int, int], ...] = CANDIDATE_GEMM_TILES

    def __post_init__(self) -> None:
        # every candidate's row tile is a multiple of `quantum`, so the choice only depends on
        # ceil(rows / quantum): cache on that (predictions ask about many nearby row counts)
        object.__setattr__(self, "quantum", math.gcd(*(tile[0] for tile in self.candidates)))

    def gemm_tile(self, rows: int, cols: int) -> tuple[int, int]:
        quantum = self.quantum
        return self._best_tile(-(-rows // quantum) * quantum, cols)

    @lru_cache(maxsize=16384)
    def _best_tile(self, rows: int, cols: int) -> tuple[int, int]:
        slots = self.device_units * self.blocks_per_unit
        best, best_cost = self.candidates[0], None
        for tile in self.candidates:
            cost = ceil_div(gemm_grid(rows, cols, tile), slots) * tile[0] * tile[1]
            if best_cost is None or cost < best_cost:
                best, best_cost = tile, cost
        return best
