"""The latency estimator (Bullet §3.2) — what the policies call through their `Predictor` protocol
(`bullet.policies.predict`): SRM over the op inventory, calibrated per kernel and per phase,
corrected online, with decode's bandwidth reduced by a co-running prefill.

Prediction is on the scheduler's critical path, so the per-kernel work is split in two:
* what depends only on the row count T (alpha of each kernel, FLOPs, bytes, grid) is computed once
  per T and cached — the policies ask about the same batches for many unit counts;
* what depends on the unit count is a handful of multiply/max per GEMM, and one term for all the
  element-wise kernels together (they are memory-bound at any unit count, checked at build time).
`breakdown()` evaluates the same model kernel by kernel, the slow way; tests hold the two equal.

On top of that, whole predictions before the online correction are memoised (`_prefill`, `_decode`):
a scheduler asks about the same batch many times — every share it weighs, every pass until the
batch changes, and once more when it observes the step — and the answer only changes when the
calibration does (`refit()` forgets them). The online correction, which moves with every
observation, is applied after the memo, so a memoised prediction is the same number, to the bit."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from engines.model_config import ModelConfig
from estimator.calibration import CO_RUN, PHASES, AlphaCurve, Calibration, by_units
from estimator.contention import ContentionModel
from estimator.hardware import DTYPE_BYTES, HardwareSpec
from estimator.kernel_model import KernelModel
from estimator.ops import ExecutionState, head_ops, layer_ops
from estimator.tensor_parallel import TensorParallel

_MEMO_LIMIT = 1 << 16  # predictions remembered per phase before the memo starts afresh


class Estimator:
    """Latency of prefill and decode steps of `model` on `units` of `hardware`'s units.

    Feed it measurements with `add_sample` (offline, Eq. 2) and `observe_prefill` /
    `observe_decode` (online); change `contention` or `calibration.samples` directly, then `refit()`."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, calibration: Calibration | None = None,
                 contention: ContentionModel | None = None, dtype: str = "bf16", weight_dtype: str | None = None,
                 tensor_parallel: TensorParallel | None = None):
        """`weight_dtype`: what the projection weights are stored in, where not `dtype` (fp8: a byte
        each; the GEMMs are still priced at `dtype`'s rate). `tensor_parallel`: `model` is one rank's
        shard (`estimator.tensor_parallel.shard_model`) and each step also pays these collectives."""
        self.model = model
        self.hardware = hardware
        self.calibration = calibration if calibration is not None else Calibration()
        self.contention = contention if contention is not None else ContentionModel()
        self.dtype = dtype
        self.weight_dtype = weight_dtype if weight_dtype != dtype else None
        weight_bytes = DTYPE_BYTES[self.weight_dtype] if self.weight_dtype else None
        self.tensor_parallel = tensor_parallel
        self.kernels = KernelModel(model, hardware, DTYPE_BYTES[dtype], dtype, weight_bytes, tensor_parallel)
        self._refits = 0
        self.refit()

    # ---- building ---------------------------------------------------------------------------

    def refit(self) -> None:
        """Rebuild the alpha curves and contention tables (after changing samples or tables)."""
        self._refits += 1  # `prediction_epoch`
        self._contention = self.contention.lookup()
        self._prefill_memo: dict[tuple, float] = {}
        self._prefill_kernels_memo: dict[tuple, float] = {}
        self._prefill_layer_memo: dict[tuple, float] = {}
        self._online_phases: tuple = (None, 0, frozenset())  # (factors dict, its size, its phases): `_corrects`
        self._decode_memo: dict[tuple, float] = {}
        self.kernels.fit(self.calibration)
        # phase -> per unit count, the alpha curves (and weights) of Eq. 2 at the sampled counts
        self._phase_curves: dict[str, list[tuple[tuple[AlphaCurve, float], ...]]] = {}
        # phase -> for every unit count strictly between two sampled ones, those two (see `_monotone`)
        self._between: dict[str, dict[int, tuple[int, int]]] = {}
        for phase in PHASES:
            samples = self.calibration.of_kind(phase)
            if samples:
                points = [(s.units, (self._phase_size(s), self._kernel_level_time(s), s.seconds)) for s in samples]
                self._phase_curves[phase] = by_units(points, self.calibration.mode(phase), self.hardware.units)
                sampled = sorted({s.units for s in samples})
                self._between[phase] = {u: (lo, hi) for lo, hi in zip(sampled, sampled[1:]) for u in range(lo + 1, hi)}

    def add_sample(self, kind: str, seconds: float, units: int, **state) -> None:
        """Record a measurement (see `Calibration.add`) and refit."""
        self.calibration.add(kind, seconds, units, **state)
        self.refit()

    @staticmethod
    def _phase_size(sample) -> int:
        if sample.kind == "hybrid":
            return sum(sample.prefill_lens) + sample.decode_batch  # rows
        return sum(sample.prefill_lens) if sample.kind == "prefill" else sample.decode_batch

    def _kernel_level_time(self, sample) -> float:
        """What the per-kernel model alone predicts for a phase sample."""
        if sample.kind == "hybrid":
            return self._hybrid_kernels([(n, 0) for n in sample.prefill_lens], sample.decode_batch,
                                        sample.decode_context, sample.units)
        if sample.kind == "prefill":
            return self._prefill(list(sample.prefill_lens), sample.units, sample.num_layers, sample.include_head,
                                 sample.co_running, False)
        return self._decode(sample.decode_batch, sample.decode_context, sample.units, sample.co_running,
                            sample.include_head, sample.num_layers, False)

    # ---- prediction ---------------------------------------------------------------------------

    def prefill_time(self, seq_lens: Sequence[int], units: int, num_layers: int | None = None,
                     include_head: bool = True, co_decode_batch: int = 0,
                     cached: Sequence[int] | None = None) -> float:
        """Seconds to run `num_layers` layers (default all) of a packed prefill of `seq_lens` on
        `units` units, plus embedding and LM head if `include_head`, with a decode batch of
        `co_decode_batch` requests running on the other units. `cached`: tokens of each sequence
        already in the KV pool (a prefix cache hit) that its new tokens attend to."""
        if not 0 < units <= self.hardware.units:
            raise ValueError(f"units must be in 1..{self.hardware.units}, got {units}")
        seconds = self._prefill(seq_lens, units, num_layers, include_head, co_decode_batch, True, cached)
        if self._corrects("prefill"):
            seconds *= self.calibration.online.factor("prefill", sum(seq_lens), units, self.hardware.units,
                                                       co_decode_batch > 0)
        return seconds

    def decode_time(self, batch: int, context: int, units: int, co_prefill_tokens: int = 0,
                    include_head: bool = True, num_layers: int | None = None) -> float:
        """Seconds for one decode step of all layers (+ LM head) of `batch` requests holding
        `context` KV tokens in all (each counting the token being decoded) on `units` units, with a
        prefill of `co_prefill_tokens` tokens running on the other units."""
        if batch < 0 or context < 0:
            raise ValueError(f"a decode batch needs batch >= 0 and context >= 0, got ({batch}, {context})")
        if not 0 < units <= self.hardware.units:
            raise ValueError(f"units must be in 1..{self.hardware.units}, got {units}")
        seconds = self._decode(batch, context, units, co_prefill_tokens, include_head, num_layers, True)
        if self._corrects("decode"):
            seconds *= self.calibration.online.factor("decode", batch, units, self.hardware.units, co_prefill_tokens > 0)
        return seconds

    def prediction_epoch(self, phase: str) -> int | None:
        """A number that stays the same for as long as every `phase` prediction does — a caller may
        keep what it derived from them until it changes: the count of refits, while the online
        correction holds no factor for `phase` (a prefill worker's estimator never observes decode);
        None while it does (the factors move with every observation)."""
        return None if self._corrects(phase) else self._refits

    def _corrects(self, phase: str) -> bool:
        """The online correction holds a factor for `phase` (else it is 1.0 for every state, and
        x * 1.0 is x: the multiplication is skipped). A prefill worker's estimator asks about decode
        all the time and observes only prefill."""
        factors = self.calibration.online.factors
        if not factors:
            return False
        seen = self._online_phases
        if seen[0] is not factors or seen[1] != len(factors):  # another dict, or keys added since
            seen = self._online_phases = (factors, len(factors), frozenset(k.split("/", 1)[0].removesuffix(CO_RUN) for k in factors))
        return phase in seen[2]

    # ---- one state over many shares ------------------------------------------------------------
    # A scheduler weighing shares asks about one batch on share after share, and stops at the first
    # that fits: these yield, lazily, exactly what `prefill_time` / `decode_time` return for each
    # share, with the per-call work done once.

    def prefill_times(self, seq_lens: Sequence[int], units: Iterable[int], num_layers: int | None = None,
                      include_head: bool = True, co_decode_batch: int = 0,
                      cached: Sequence[int] | None = None) -> Iterator[float]:
        """`prefill_time(seq_lens, u, ...)` for each `u` of `units`, lazily."""
        total, online, memo = self.hardware.units, self.calibration.online, self._prefill_memo
        corrects, co = self._corrects("prefill"), co_decode_batch > 0
        lens, tokens = tuple(seq_lens), sum(seq_lens)
        cached = tuple(cached) if cached and any(cached) else None
        for u in units:
            if not 0 < u <= total:
                raise ValueError(f"units must be in 1..{total}, got {u}")
            seconds = memo.get((lens, u, num_layers, include_head, co_decode_batch, True, cached))
            if seconds is None:
                seconds = self._prefill(lens, u, num_layers, include_head, co_decode_batch, True, cached)
            if corrects:
                seconds *= online.factor("prefill", tokens, u, total, co)
            yield seconds

    def decode_times(self, batch: int, context: int, units: Iterable[int], co_prefill_tokens: int = 0) -> Iterator[float]:
        """`decode_time(batch, context, u, co_prefill_tokens)` for each `u` of `units`, lazily."""
        if batch < 0 or context < 0:
            raise ValueError(f"a decode batch needs batch >= 0 and context >= 0, got ({batch}, {context})")
        total, online, memo = self.hardware.units, self.calibration.online, self._decode_memo
        corrects, co = self._corrects("decode"), co_prefill_tokens > 0
        for u in units:
            if not 0 < u <= total:
                raise ValueError(f"units must be in 1..{total}, got {u}")
            seconds = memo.get((batch, context, u, co_prefill_tokens, True, None, True, None))
            if seconds is None:
                seconds = self._decode(batch, context, u, co_prefill_tokens, True, None, True)
            if corrects:
                seconds *= online.factor("decode", batch, u, total, co)
            yield seconds

    def decode_time_for(self, context_lens: Sequence[int], units: int, co_prefill_tokens: int = 0,
                        include_head: bool = True, num_layers: int | None = None) -> float:
        """`decode_time` of requests with these contexts: exact on an engine that pads decode
        attention to the longest context (the CPU engine), where only the lengths say what it reads."""
        return self.decode_time(*self.decode_reads(context_lens), units, co_prefill_tokens, include_head, num_layers)

    def decode_reads(self, context_lens: Sequence[int]) -> tuple[int, int]:
        """(batch, KV tokens attention reads) of a decode step over these contexts."""
        batch = len(context_lens)
        if self.hardware.decode_attention_padded and batch:
            return batch, batch * max(context_lens)
        return batch, int(sum(context_lens))

    def _prefill(self, seq_lens, units, num_layers, include_head, co_decode_batch, phase_alpha,
                 cached: Sequence[int] | None = None) -> float:
        if not seq_lens:
            return 0.0
        lens = tuple(seq_lens)
        cached = tuple(cached) if cached and any(cached) else None
        key = (lens, units, num_layers, include_head, co_decode_batch, phase_alpha, cached)
        memo = self._prefill_memo
        seconds = memo.get(key)
        if seconds is None:
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            # the kernels' part does not depend on the decode batch beside it: memoised apart, and its
            # per-layer part apart again (an in-flight batch is asked about with fewer layers each step)
            kernel_key = (lens, units, num_layers, include_head, cached)
            seconds = self._prefill_kernels_memo.get(kernel_key)
            if seconds is None:
                if len(self._prefill_kernels_memo) >= _MEMO_LIMIT:
                    self._prefill_kernels_memo.clear()
                seconds = self._prefill_kernels_memo[kernel_key] = self._prefill_kernels(lens, units, num_layers,
                                                                                         include_head, cached)
            if co_decode_batch:
                seconds *= self._contention.prefill_slowdown_factor(co_decode_batch)
            if phase_alpha and "prefill" in self._phase_curves:
                tokens = sum(lens)
                seconds = self._phase_calibrated("prefill", units, tokens, seconds)
                around = self._between["prefill"].get(units)
                if around is not None:
                    seconds = _monotone(seconds, *(self._prefill(seq_lens, u, num_layers, include_head,
                                                                 co_decode_batch, phase_alpha, cached) for u in around))
            memo[key] = seconds
        return seconds

    def _prefill_kernels(self, seq_lens, units, num_layers, include_head, cached: Sequence[int] | None) -> float:
        """The kernel-level model of a prefill alone (before contention and the phase calibration)."""
        k = self.kernels
        tokens = sum(seq_lens)
        layer_key = (seq_lens, units, cached)
        layer = self._prefill_layer_memo.get(layer_key)
        if layer is None:
            if cached:  # new tokens after a cached prefix: they attend to it and read it back
                attention = k.chunk_attention_time(seq_lens, cached, units)
            else:
                attention = k.prefill_attention_time(seq_lens, tokens, units)
            layer = k.token_ops_time(tokens, units, 1.0) + attention
            if len(self._prefill_layer_memo) >= _MEMO_LIMIT:
                self._prefill_layer_memo.clear()
            self._prefill_layer_memo[layer_key] = layer
        seconds = layer * (self.model.num_hidden_layers if num_layers is None else num_layers)
        if include_head:
            seconds += k.head_time(tokens, len(seq_lens), units, 1.0)
        return seconds

    def _phase_calibrated(self, phase: str, units: int, size: int, seconds: float) -> float:
        """Eq. 2's phase alpha applied to a kernel-level time: the blend of the curves at the sampled
        unit counts around `units` (one curve, weight 1, where alpha was sampled at one count: then
        `sum` of the one term is that term, to the bit)."""
        blend = self._phase_curves[phase][units]
        if len(blend) == 1 and blend[0][1] == 1.0:
            return blend[0][0].calibrated(size, seconds)
        return sum(w * curve.calibrated(size, seconds) for curve, w in blend)

    def decode_time_at_bandwidth(self, batch: int, context: int, units: int, fraction: float,
                                 include_head: bool = True, num_layers: int | None = None) -> float:
        """A decode step with its units' memory bandwidth scaled by `fraction`: what an entry
        D_{p,sl} / D_p of the contention table means. The profiler solves for the fraction that
        reproduces decode steps measured beside a prefill. No online correction."""
        return self._decode(batch, context, units, 0, include_head, num_layers, True, scale=fraction)

    def _decode(self, batch, context, units, co_prefill_tokens, include_head, num_layers, phase_alpha,
                scale: float | None = None) -> float:
        if batch <= 0:
            return 0.0
        key = (batch, context, units, co_prefill_tokens, include_head, num_layers, phase_alpha, scale)
        memo = self._decode_memo
        seconds = memo.get(key)
        if seconds is None:
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            seconds = memo[key] = self._decode_uncached(batch, context, units, co_prefill_tokens, include_head,
                                                        num_layers, phase_alpha, scale)
        return seconds

    def _decode_uncached(self, batch, context, units, co_prefill_tokens, include_head, num_layers, phase_alpha,
                         scale: float | None) -> float:
        k = self.kernels
        if scale is None:
            scale = self._contention.decode_bandwidth_fraction(co_prefill_tokens, units) if co_prefill_tokens else 1.0
        layer = k.token_ops_time(batch, units, scale) + k.decode_attention_time(batch, context, units, scale)
        seconds = layer * (self.model.num_hidden_layers if num_layers is None else num_layers)
        if include_head:
            seconds += k.head_time(batch, batch, units, scale)
        if phase_alpha and "decode" in self._phase_curves:
            seconds = self._phase_calibrated("decode", units, batch, seconds)
            around = self._between["decode"].get(units)
            if around is not None:
                seconds = _monotone(seconds, *(self._decode(batch, context, u, co_prefill_tokens, include_head,
                                                            num_layers, phase_alpha, scale) for u in around))
        return seconds

    def step_time(self, state: ExecutionState, units: int) -> float:
        """One hybrid step (chunked-prefill baselines): prefill chunks and decode requests share
        every linear kernel; attention runs once for each part. Kernel-level model only."""
        rows = [op for op in layer_ops(self.model, state, self.kernels.dtype_bytes, self.kernels.tiling,
                                       self.hardware.prefill_attention_per_sequence, self.kernels.weight_bytes)]
        layer = sum(self.kernels.op_time(op, units) for op in rows)
        head = sum(self.kernels.op_time(op, units) for op in head_ops(self.model, state, self.kernels.dtype_bytes,
                                                                          self.kernels.tiling))
        tp = self.kernels.tp
        if tp is not None:
            layer += tp.layer_time(state.tokens, units)
            head += tp.head_time(state.tokens, state.output_rows, units)
        return layer * self.model.num_hidden_layers + head

    def hybrid_step_time(self, chunks: Sequence[tuple[int, int]], decode_batch: int = 0, decode_context: int = 0,
                         units: int | None = None) -> float:
        """One hybrid step on the fast paths: prefill `chunks` given as (new tokens, tokens of the
        prompt already cached — attended to and read back, the chunked baseline's "KV reloads") and
        a decode batch, sharing every linear kernel. Equals `step_time` on the same state, then takes
        the phase calibration (Eq. 2) of decode when the step decodes, else of prefill — so a
        decode-only step costs exactly `decode_time` and an unchunked prefill `prefill_time`, which
        keeps the chunked baseline and the two-worker policies on one footing. No contention (one
        process) and no online correction."""
        units = self.hardware.units if units is None else units
        if not 0 < units <= self.hardware.units:
            raise ValueError(f"units must be in 1..{self.hardware.units}, got {units}")
        tokens = sum(c for c, _ in chunks)
        rows = tokens + decode_batch
        if rows == 0:
            return 0.0
        seconds = self._hybrid_kernels(chunks, decode_batch, decode_context, units)
        # a step of both takes the measured hybrid steps' calibration where the profile has some; else
        # decode's (its curve is over rows: a step carrying a large chunk gets the alpha of a large
        # batch, close to the kernel-level model); a decode-only step decode_time's, prompts only prefill's
        if chunks and decode_batch and "hybrid" in self._phase_curves:
            phase, size = "hybrid", rows
        else:
            phase, size = ("decode", rows) if decode_batch else ("prefill", tokens)
        if phase in self._phase_curves:
            seconds = self._phase_calibrated(phase, units, size, seconds)
        return seconds

    def _hybrid_kernels(self, chunks: Sequence[tuple[int, int]], batch: int, context: int, units: int) -> float:
        """The kernel-level model of a hybrid step (before any phase calibration)."""
        new = [c for c, _ in chunks]
        rows = sum(new) + batch
        k = self.kernels
        layer = k.token_ops_time(rows, units, 1.0)
        if chunks:
            layer += k.chunk_attention_time(new, [p for _, p in chunks], units)
        if batch:
            layer += k.decode_attention_time(batch, context, units)
        return layer * self.model.num_hidden_layers + k.head_time(rows, len(new) + batch, units, 1.0)

    def breakdown(self, state: ExecutionState, units: int, bandwidth_scale: float = 1.0) -> list[tuple[str, float, float]]:
        """(kernel, SRM seconds, calibrated seconds) of one layer then the head ops, kernel by kernel;
        under tensor parallelism the layer's rows end with its all-reduces ("tp_all_reduce") and the
        head's with its collectives ("tp_head_collectives")."""
        k = self.kernels
        ops = (layer_ops(self.model, state, k.dtype_bytes, k.tiling, self.hardware.prefill_attention_per_sequence,
                         k.weight_bytes)
               + head_ops(self.model, state, k.dtype_bytes, k.tiling))
        rows = [(op.name, k.srm(op, units, bandwidth_scale), k.op_time(op, units, bandwidth_scale)) for op in ops]
        if k.tp is not None:  # the collectives, after the layer's kernels and after the head's
            layer, head = k.tp.layer_time(state.tokens, units), k.tp.head_time(state.tokens, state.output_rows, units)
            n = len(ops) - 3
            rows[n:n] = [("tp_all_reduce", layer, layer)]
            rows.append(("tp_head_collectives", head, head))
        return rows

    # ---- online refinement ------------------------------------------------------------------

    def observe_prefill(self, seq_lens: Sequence[int], units: int, seconds: float, num_layers: int | None = None,
                        include_head: bool = True, co_decode_batch: int = 0) -> None:
        predicted = self._prefill(seq_lens, units, num_layers, include_head, co_decode_batch, True)
        if predicted > 0 and seconds > 0:
            self.calibration.online.observe("prefill", sum(seq_lens), units, self.hardware.units, seconds / predicted,
                                            co_decode_batch > 0)

    def observe_decode(self, context_lens: Sequence[int], units: int, seconds: float, co_prefill_tokens: int = 0,
                       include_head: bool = True, num_layers: int | None = None) -> None:
        """A decode step over requests with these contexts took `seconds` (online refinement)."""
        batch, context = self.decode_reads(context_lens)
        predicted = self._decode(batch, context, units, co_prefill_tokens, include_head, num_layers, True)
        if predicted > 0 and seconds > 0:
            self.calibration.online.observe("decode", batch, units, self.hardware.units, seconds / predicted,
                                            co_prefill_tokens > 0)

    def __repr__(self) -> str:
        kinds = ", ".join(sorted(self.calibration.kinds())) or "none"
        weights = f", {self.weight_dtype} weights" if self.weight_dtype else ""
        tp = self.kernels.tp
        ranks = f", one of {tp.ranks} tensor-parallel ranks over {tp.link.name}" if tp is not None else ""
        return (f"Estimator({self.model.name} on {self.hardware.name}, {self.dtype}{weights}{ranks}, "
                f"calibrated: {kinds})")


def _monotone(seconds: float, at_fewer: float, at_more: float) -> float:
    """A step on units between two calibrated counts takes no longer than on the fewer and no less
    than on the more. Each count's curves are fitted to its own samples, and their blend in between
    can leave both: a measured H200 profile (samples at 24, 40, 72 and 132 SMs) priced one decode step
    10.9 ms on 24 SMs, 14.0 on 32 and 8.8 on 40 — and a policy choosing the fewest units that keep a
    target believes it."""
    if at_fewer < at_more:  # the samples themselves disagree (noise): leave the blend alone
        return seconds
    return min(max(seconds, at_more), at_fewer)

