"""Where batching more prompts stops paying (Algorithm 1, ARITHINTEN < peak): a prefill batch of T
tokens reads each layer's weights once and does ~2·T FLOPs per weight, so its arithmetic intensity
grows with T until it reaches the device's ridge point (compute rate / bandwidth on the units it
has); beyond that, more tokens only lengthen the step."""

from __future__ import annotations

import functools

from engines.model_config import ModelConfig
from estimator.hardware import HardwareSpec
from estimator.ops import layer_token_ops


def intensity(model: ModelConfig, tokens: int, dtype_bytes: int = 2, ops=None) -> float:
    """FLOPs per byte of one layer's per-token kernels over `tokens` rows (`ops`: that layer's
    `layer_token_ops`, when the caller has them). A mixture of experts reads more expert weights as
    the batch grows (`estimator.ops.expected_experts`); its intensity still grows with the tokens."""
    ops = layer_token_ops(model, dtype_bytes) if ops is None else ops
    flops = sum(op.flops_per_row * tokens * op.count for op in ops)
    moved = sum(op.bytes_at(tokens) * op.count for op in ops)
    return flops / moved


def ridge_token_limit(model: ModelConfig, hardware: HardwareSpec, dtype: str = "bf16", dtype_bytes: int = 2,
                      cap: int = 1 << 16, weight_bytes: int | None = None):
    """A function units -> the smallest batch size (tokens) whose intensity reaches the ridge point
    (`weight_bytes`: the projections' weights, if not stored in `dtype_bytes`)."""

    ops = layer_token_ops(model, dtype_bytes, weight_bytes)  # built once: the search asks ~17 times per share

    @functools.lru_cache(maxsize=None)
    def limit(units: int) -> int:
        units = max(1, min(units, hardware.units))
        ridge = hardware.compute_rate(units, dtype) / hardware.bandwidth(units)
        lo, hi = 1, cap
        if intensity(model, hi, dtype_bytes, ops) < ridge:
            return cap
        while lo < hi:  # intensity is increasing in tokens
            mid = (lo + hi) // 2
            if intensity(model, mid, dtype_bytes, ops) >= ridge:
                hi = mid
            else:
                lo = mid + 1
        return lo

    return limit
