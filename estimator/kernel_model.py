"""Calibrated per-kernel latencies (SRM x alpha) for one (model, device, dtype), with the fast paths
the predictor uses. `op_time` is the reference: one kernel, straight from the formulas."""

from __future__ import annotations

import math

from engines.model_config import ModelConfig
from estimator.calibration import FALLBACK_CLASS, SRM_MODES, AlphaCurve, Calibration, unit_blend
from estimator.hardware import HardwareSpec
from estimator.ops import (
    ATTENTION_CLASSES,
    Op,
    TokenOp,
    decode_attention,
    head_token_ops,
    layer_token_ops,
    prefill_attention,
)
from estimator.srm import srm_time
from estimator.tensor_parallel import TensorParallel
from estimator.tiling import ATTN_QUERY_TILE, FixedTiling, HeuristicTiling, decode_attention_grid

_CACHE_LIMIT = 8192  # distinct row counts (or calls) remembered per kernel group (or memo)


def _apply(curve: AlphaCurve | None, size: float, srm: float) -> float:
    return srm if curve is None else curve.calibrated(size, srm)


class _TokenGroup:
    """Kernels that all see the same row count. Per row count the unit-independent part (alpha,
    FLOPs, bytes, grid) is cached; per call only the roofline of each GEMM is evaluated, plus one
    term for all memory-bound kernels together."""

    def __init__(self, kernels: "KernelModel", ops: tuple[TokenOp, ...], curves: dict[str, AlphaCurve | None]):
        self.k = kernels
        self.ops = ops
        self.memory_bound = tuple(op.cols == 0 and kernels.always_memory_bound(op) for op in ops)
        self.cache: dict[int, tuple] = {}
        self.compiled: tuple = ()
        self.compile(curves)

    def compile(self, curves: dict[str, AlphaCurve | None]) -> None:
        """Flatten each kernel's coefficients and alpha segment into a tuple."""
        rows = []
        for op, memory_bound in zip(self.ops, self.memory_bound):
            curve = curves.get(op.name)
            if curve is None:
                segment = (0.0, 0.0, 1.0, 1.0)
            elif curve.mode == "log" and len(curve.alphas) <= 2:
                segment = curve.segment()
            else:
                segment = None  # a mode on the SRM time, or more than two points: evaluated by the curve itself
            rows.append((op, memory_bound, curve, segment))
        self.compiled = tuple(rows)
        self.cache.clear()

    def _entry(self, rows: int) -> tuple:
        k = self.k
        log_rows = math.log(rows) if rows > 1 else 0.0
        mem_weighted, weight_sum, gemms, by_srm = 0.0, 0.0, [], []
        for op, memory_bound, curve, segment in self.compiled:
            if segment is not None:
                x0, x1, a0, a1 = segment
                alpha = a0 if log_rows <= x0 else a1 if log_rows >= x1 else a0 + (a1 - a0) * (log_rows - x0) / (x1 - x0)
            elif curve.mode in SRM_MODES:
                grid = op.grid_at(rows, k.tiling) if k.waves else 0
                by_srm.append((op.count, op.flops_per_row * rows, op.bytes_at(rows), grid, curve))
                continue
            else:
                alpha = curve.alpha_at_log_size(log_rows)
            weight = op.count * alpha
            weight_sum += weight
            nbytes = op.bytes_at(rows)
            if memory_bound:
                mem_weighted += weight * nbytes
            else:
                grid = op.grid_at(rows, k.tiling) if k.waves else 0
                gemms.append((weight, op.flops_per_row * rows, nbytes, grid))
        entry = (mem_weighted, weight_sum, tuple(gemms), tuple(by_srm))
        if len(self.cache) >= _CACHE_LIMIT:
            self.cache.clear()
        self.cache[rows] = entry
        return entry

    def time(self, rows: int, units: int, bandwidth_scale: float) -> float:
        entry = self.cache.get(rows) or self._entry(rows)
        mem_weighted, weight_sum, gemms, by_srm = entry
        k = self.k
        inv_c = k.inv_compute[units]
        inv_d = k.inv_bandwidth[units] / bandwidth_scale
        slots = units * k.blocks_per_unit
        seconds = mem_weighted * inv_d + weight_sum * k.overhead
        for weight, flops, nbytes, grid in gemms:
            compute = flops * inv_c
            if grid:
                compute *= -(-grid // slots) * slots / grid
            memory = nbytes * inv_d
            seconds += weight * (compute if compute > memory else memory)
        for count, flops, nbytes, grid, curve in by_srm:  # the SRM of one launch, then its curve
            compute = flops * inv_c
            if grid:
                compute *= -(-grid // slots) * slots / grid
            memory = nbytes * inv_d
            seconds += count * curve.calibrated(rows, k.overhead + (compute if compute > memory else memory))
        return seconds


class _CurveSet:
    """The alpha curve of every kernel class at one sampled unit count (or at all unit counts,
    when alpha was sampled at one), with the token groups compiled from them."""

    def __init__(self, kernels: "KernelModel", curves: dict[str, AlphaCurve | None]):
        self.curves = curves
        self.layer = _TokenGroup(kernels, kernels.layer_ops, curves)
        self.head_rows = _TokenGroup(kernels, kernels.head_row_ops, curves)
        self.lm_head = _TokenGroup(kernels, kernels.lm_head_ops, curves)


class KernelModel:
    """`weight_bytes`: the size of a projection weight where it is not `dtype_bytes` (FP8 weights: 1).
    `tensor_parallel`: `model` is one rank's shard, and every layer (and the head) also pays these
    collectives (`estimator.tensor_parallel`); None: one device runs the whole model."""

    def __init__(self, model: ModelConfig, hw: HardwareSpec, dtype_bytes: int = 2, dtype: str = "bf16",
                 weight_bytes: int | None = None, tensor_parallel: TensorParallel | None = None):
        self.model, self.hw, self.dtype_bytes, self.dtype = model, hw, dtype_bytes, dtype
        self.weight_bytes = weight_bytes
        # one rank alone exchanges nothing: left out, so its times are the single-device ones to the bit
        self.tp = tensor_parallel if tensor_parallel is not None and tensor_parallel.ranks > 1 else None
        self.waves = hw.wave_quantization
        self.blocks_per_unit = hw.blocks_per_unit
        self.overhead = hw.kernel_overhead_s
        self.tiling = HeuristicTiling(hw.units, hw.blocks_per_unit) if self.waves else FixedTiling()
        self.inv_compute = [0.0] + [1.0 / hw.compute_rate(u, dtype) for u in range(1, hw.units + 1)]
        self.inv_bandwidth = [0.0] + [1.0 / hw.bandwidth(u) for u in range(1, hw.units + 1)]
        # compute time / memory time of a 1 FLOP/byte kernel, at its worst over all unit counts
        self._worst_ratio = max(c / d for c, d in zip(self.inv_compute[1:], self.inv_bandwidth[1:]))
        heads, d, q, kv = model.num_attention_heads, model.head_dim, model.q_size, model.kv_size
        self._prefill_attn = (2.0 * heads * d, float((2 * q + 4 * kv) * dtype_bytes), heads)
        self._decode_attn = (4.0 * heads * d, float(2 * kv * dtype_bytes), float((2 * q + 2 * kv) * dtype_bytes),
                             model.num_key_value_heads)
        self.curves: dict[str, AlphaCurve | None] = {}
        embedding, final_norm, lm_head = head_token_ops(model, dtype_bytes)
        self.layer_ops = layer_token_ops(model, dtype_bytes, weight_bytes)
        self.head_row_ops, self.lm_head_ops = (embedding, final_norm), (lm_head,)
        self._token_ops = {op.name: op for op in self.layer_ops + (embedding, final_norm, lm_head)}
        # per unit count (index): the curve sets a prediction blends, with their weights
        self._blend: list[tuple[tuple[_CurveSet, float], ...]] = []
        self.fit(Calibration())

    def always_memory_bound(self, op: TokenOp) -> bool:
        return op.flops_per_row * self._worst_ratio <= op.bytes_per_row

    # ---- calibration --------------------------------------------------------------------------

    def sample_op(self, sample) -> Op:
        """The kernel a calibration sample timed, in the sample's state."""
        if sample.kind == "attn_prefill":
            return prefill_attention(self.model, sample.prefill_lens, self.dtype_bytes)
        if sample.kind == "attn_decode":
            return decode_attention(self.model, sample.decode_batch, sample.decode_context, self.dtype_bytes)
        return self._token_ops[sample.kind].at(sample.tokens, self.tiling)

    def fit(self, calibration: Calibration) -> None:
        """Alpha curves from the kernel samples: one set if they were all taken at one unit count,
        else one set per sampled count, blended between counts (`calibration.unit_blend`)."""
        self._layer_memo: dict[tuple, float] = {}  # (rows, units, bandwidth scale) -> token_ops_time
        self._head_memo: dict[tuple, float] = {}  # (rows, output rows, units, bandwidth scale) -> head_time
        samples = [s for s in calibration.samples if s.kind in self._token_ops or s.kind in ATTENTION_CLASSES]
        counts = sorted({s.units for s in samples})
        if len(counts) <= 1:
            one = _CurveSet(self, self._curves(samples, calibration))
            self._blend = [((one, 1.0),)] * (self.hw.units + 1)
            self.curves = one.curves
            return
        sets = {u: _CurveSet(self, self._curves([s for s in samples if s.units == u], calibration)) for u in counts}
        self._blend = [((sets[counts[0]], 1.0),)] + [
            tuple((sets[u], w) for u, w in unit_blend(counts, units)) for units in range(1, self.hw.units + 1)]
        self.curves = sets[counts[-1]].curves

    def _curves(self, samples, calibration: Calibration) -> dict[str, AlphaCurve | None]:
        points: dict[str, list] = {}
        for s in samples:
            op = self.sample_op(s)
            points.setdefault(s.kind, []).append((op.size, self.srm(op, s.units) / op.count, s.seconds))
        fitted = {kind: AlphaCurve(pts, calibration.mode(kind)) for kind, pts in points.items()}
        names = list(self._token_ops) + list(ATTENTION_CLASSES)
        return {n: fitted.get(n, fitted.get(FALLBACK_CLASS.get(n, ""))) for n in names}

    # ---- one kernel, the reference way ------------------------------------------------------------

    def srm(self, op: Op, units: int, bandwidth_scale: float = 1.0) -> float:
        return srm_time(op, units, self.hw, self.dtype, bandwidth_scale)

    def op_time(self, op: Op, units: int, bandwidth_scale: float = 1.0) -> float:
        srm = self.srm(op, units, bandwidth_scale) / op.count
        return op.count * sum(w * _apply(s.curves.get(op.name), op.size, srm) for s, w in self._blend[units])

    # ---- fast paths -----------------------------------------------------------------------------

    # Both are memoised per (rows, units, scale): the same batch sizes come back all the time, and a
    # decode step's per-token kernels do not depend on its context. `fit` forgets them.

    def token_ops_time(self, rows: int, units: int, bandwidth_scale: float = 1.0) -> float:
        """One layer's per-token kernels (everything but attention) over `rows` rows, and under tensor
        parallelism its collectives."""
        key = (rows, units, bandwidth_scale)
        seconds = self._layer_memo.get(key)
        if seconds is None:
            blend = self._blend[units]
            if len(blend) == 1:
                seconds = blend[0][0].layer.time(rows, units, bandwidth_scale)
            else:
                seconds = sum(w * s.layer.time(rows, units, bandwidth_scale) for s, w in blend)
            if self.tp is not None:  # the layer's all-reduces, in series with its kernels
                seconds += self.tp.layer_time(rows, units)
            if len(self._layer_memo) >= _CACHE_LIMIT:
                self._layer_memo.clear()
            self._layer_memo[key] = seconds
        return seconds

    def head_time(self, rows: int, output_rows: int, units: int, bandwidth_scale: float = 1.0) -> float:
        key = (rows, output_rows, units, bandwidth_scale)
        seconds = self._head_memo.get(key)
        if seconds is None:
            blend = self._blend[units]
            if len(blend) == 1 and blend[0][1] == 1.0:  # the sum of one term 1.0 * x is x, to the bit
                s = blend[0][0]
                seconds = s.head_rows.time(rows, units, bandwidth_scale) + s.lm_head.time(output_rows, units,
                                                                                            bandwidth_scale)
            else:
                seconds = sum(w * (s.head_rows.time(rows, units, bandwidth_scale)
                                   + s.lm_head.time(output_rows, units, bandwidth_scale)) for s, w in blend)
            if self.tp is not None:
                seconds += self.tp.head_time(rows, output_rows, units)
            if len(self._head_memo) >= _CACHE_LIMIT:
                self._head_memo.clear()
            self._head_memo[key] = seconds
        return seconds

    def _attention(self, name: str, size: int, srm: float, units: int) -> float:
        blend = self._blend[units]
        if len(blend) == 1:
            return _apply(blend[0][0].curves[name], size, srm)
        return sum(w * _apply(s.curves[name], size, srm) for s, w in blend)

    def _roofline(self, flops: float, nbytes: float, grid: int, units: int, bandwidth_scale: float) -> float:
        compute = flops * self.inv_compute[units]
        if self.waves and grid:
            slots = units * self.blocks_per_unit
            compute *= -(-grid // slots) * slots / grid
        memory = nbytes * self.inv_bandwidth[units] / bandwidth_scale
        return self.overhead + (compute if compute > memory else memory)

    def prefill_attention_time(self, seq_lens, tokens: int, units: int) -> float:
        per_square, per_token, heads = self._prefill_attn
        if self.hw.prefill_attention_per_sequence and len(seq_lens) > 1:
            return sum(self.prefill_attention_time((s,), s, units) for s in seq_lens)
        square = tiles = 0
        for s in seq_lens:
            square += s * (s + 1)
            tiles += -(-s // ATTN_QUERY_TILE)
        srm = self._roofline(per_square * square, per_token * tokens, heads * tiles, units, 1.0)
        return self._attention("attn_prefill", tokens, srm, units)

    def chunk_attention_time(self, chunk_lens, prefix_lens, units: int) -> float:
        """Prefill chunks against their cached prefixes (`ops.chunked_prefill_attention`), calibrated
        like prefill attention at the chunks' token count."""
        per_square, per_token, heads = self._prefill_attn
        pairs2 = tiles = tokens = prefix = 0
        for c, p in zip(chunk_lens, prefix_lens):
            pairs2 += 2 * c * p + c * (c + 1)  # twice the (query, key) pairs, as `per_square` expects
            tiles += -(-c // ATTN_QUERY_TILE)
            tokens += c
            prefix += p
        reload_bytes = 2.0 * self.model.kv_size * self.dtype_bytes * prefix
        srm = self._roofline(per_square * pairs2, per_token * tokens + reload_bytes, heads * tiles, units, 1.0)
        return self._attention("attn_prefill", tokens, srm, units)

    def decode_attention_time(self, batch: int, context: int, units: int, bandwidth_scale: float = 1.0) -> float:
        per_ctx_flops, per_ctx_bytes, per_request_bytes, kv_heads = self._decode_attn
        grid = decode_attention_grid(batch, context, kv_heads)
        srm = self._roofline(per_ctx_flops * context, per_ctx_bytes * context + per_request_bytes * batch, grid,
                             units, bandwidth_scale)
        blend = self._blend[units]
        if len(blend) == 1:  # `_attention`, inlined: every decode step of every share asks
            curve = blend[0][0].curves["attn_decode"]
            return srm if curve is None else curve.calibrated(context, srm)
        return self._attention("attn_decode", context, srm, units)
