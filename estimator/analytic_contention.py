"""An assumed, analytic model of what prefill and decode do to each other when they run side by side
on disjoint units (Bullet §3.2.3), for a device where the contention table has not been measured —
the simulator charges it, and can hand its table to the policies' estimators.

Units are isolated; the memory system is not. Two effects, the larger of which applies:

1. **HBM bandwidth is one resource.** The SRM gives each phase the bandwidth of its own units as if
   it were alone, so two memory-bound phases would together draw up to twice the peak. Here each
   step demands `bytes / (its latency alone)`; when the two demands exceed the peak, bandwidth is
   divided max-min fairly with shares in proportion to the units issuing requests (a phase that
   needs less than its share keeps what it needs, the other gets the rest), and a step slows by
   demand / grant. Traffic is the op inventory's minimum (weights, activations, KV once).
2. **Interference beyond bandwidth** (L2, interconnect): the paper measures that a memory-bound probe
   loses bandwidth beside a large GEMM — the more so the longer the GEMM's sequence — while the GEMM
   slows by < 8 %. Assumed shape:
       decode bandwidth fraction = 1 - (1 - floor) * (prefill units / all units) * saturation(sl)
       saturation(sl)            = min(1, arithmetic intensity of a sl-token layer / ridge point)
       prefill slowdown          = 1 + prefill_slowdown * min(1, decode units / N_d)
   `floor` and `prefill_slowdown` are assumptions, not measurements; runs report them.

`contention_table` writes both effects into the `ContentionModel` tables that `bullet profile`
would measure (decode probe on u units, a single-sequence prefill of sl tokens on all the others)."""

from __future__ import annotations

from estimator.contention import ContentionModel
from estimator.estimator import Estimator
from estimator.hardware import DTYPE_BYTES
from estimator.ops import expected_experts, head_token_ops

DEFAULT_FLOOR = 0.75  # assumption: decode keeps 75 % of its bandwidth beside a full-device GEMM
DEFAULT_PREFILL_SLOWDOWN = 0.05  # assumption: within the paper's "< 8 %" for prefill beside decode
TABLE_PREFILL_TOKENS = (32, 128, 512, 2048, 8192)


class AnalyticContention:
    def __init__(self, estimator: Estimator, floor: float = DEFAULT_FLOOR,
                 prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN):
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor must lie in (0, 1], got {floor}")
        if prefill_slowdown < 0.0:
            raise ValueError(f"prefill_slowdown must be >= 0, got {prefill_slowdown}")
        self.est, self.floor, self.prefill_slowdown = estimator, floor, prefill_slowdown
        model, hw, dt = estimator.model, estimator.hardware, DTYPE_BYTES[estimator.dtype]
        self.hardware = hw
        self.peak = hw.peak_bandwidth
        self._ridge = hw.compute_rate(hw.units, estimator.dtype) / hw.bandwidth(hw.units)
        layer = estimator.kernels.layer_ops  # with the estimator's weight bytes
        self._layer_fixed = sum(op.bytes_fixed * op.count for op in layer)
        self._layer_row = sum(op.bytes_per_row * op.count for op in layer)
        self._layer_flops_row = sum(op.flops_per_row * op.count for op in layer)
        self._layer_experts = tuple(op for op in layer if op.experts)  # weights read per expert touched
        embedding, final_norm, lm_head = head_token_ops(model, dt)
        self._head = (embedding, final_norm, lm_head)
        self._prefill_attn_row = float((2 * model.q_size + 4 * model.kv_size) * dt)
        self._kv_row = float(2 * model.kv_size * dt)
        self._decode_attn_row = float((2 * model.q_size + 2 * model.kv_size) * dt)
        self._layers = model.num_hidden_layers
        self._saturation: dict[int, float] = {}

    # ---- traffic ---------------------------------------------------------------------------------
    def _head_bytes(self, rows: int, outputs: int) -> float:
        embedding, final_norm, lm_head = self._head
        return (embedding.bytes_fixed + embedding.bytes_per_row * rows + final_norm.bytes_fixed
                + final_norm.bytes_per_row * rows + lm_head.bytes_fixed + lm_head.bytes_per_row * outputs)

    def _experts_bytes(self, rows: int) -> float:
        return sum(op.bytes_per_expert * expected_experts(rows, op.experts, op.top_k) * op.count
                   for op in self._layer_experts)

    def prefill_bytes(self, seq_lens, num_layers: int | None = None, include_head: bool = True) -> float:
        tokens = sum(seq_lens)
        layer = self._layer_fixed + (self._layer_row + self._prefill_attn_row) * tokens
        if self._layer_experts:
            layer += self._experts_bytes(tokens)
        layers = self._layers if num_layers is None else num_layers
        return layer * layers + (self._head_bytes(tokens, len(seq_lens)) if include_head else 0.0)

    def decode_bytes(self, batch: int, context: int) -> float:
        layer = self._layer_fixed + (self._layer_row + self._decode_attn_row) * batch + self._kv_row * context
        if self._layer_experts:
            layer += self._experts_bytes(batch)
        return layer * self._layers + self._head_bytes(batch, batch)

    # ---- effect 1: one HBM ------------------------------------------------------------------------
    def bandwidth_slowdowns(self, demand_p: float, units_p: float, demand_d: float, units_d: float) -> tuple[float, float]:
        """(prefill, decode) latency factors >= 1 from dividing the peak bandwidth between two
        demands (bytes/s), max-min fairly with shares in proportion to units."""
        if demand_p + demand_d <= self.peak:
            return 1.0, 1.0
        share_p = self.peak * units_p / (units_p + units_d)
        share_d = self.peak - share_p
        if demand_p <= share_p:
            grant_p, grant_d = demand_p, self.peak - demand_p
        elif demand_d <= share_d:
            grant_p, grant_d = self.peak - demand_d, demand_d
        else:
            grant_p, grant_d = share_p, share_d
        return max(1.0, demand_p / grant_p), max(1.0, demand_d / grant_d)

    # ---- effect 2: interference beyond bandwidth ----------------------------------------------------
    def saturation(self, prefill_tokens: int) -> float:
        tokens = int(prefill_tokens)
        cached = self._saturation.get(tokens)
        if cached is None:
            moved = self._layer_fixed + self._layer_row * tokens
            if self._layer_experts:
                moved += self._experts_bytes(tokens)
            intensity = self._layer_flops_row * tokens / moved
            cached = self._saturation[tokens] = min(1.0, intensity / self._ridge) if tokens > 0 else 0.0
        return cached

    def pressure_fraction(self, prefill_tokens: int, prefill_units: float) -> float:
        if prefill_tokens <= 0 or prefill_units <= 0:
            return 1.0
        pressure = min(1.0, prefill_units / self.hardware.units) * self.saturation(prefill_tokens)
        return 1.0 - (1.0 - self.floor) * pressure

    def prefill_slowdown_factor(self, decode_units: float) -> float:
        if decode_units <= 0:
            return 1.0
        return 1.0 + self.prefill_slowdown * min(1.0, decode_units / self.hardware.bandwidth_inflection)

    # ---- both, for one co-running pair of steps ---------------------------------------------------------
    def corun(self, prefill_alone: float, prefill_bytes: float, prefill_tokens: int, prefill_units: float,
              decode_alone: float, decode_bytes: float, decode_batch: tuple[int, int], decode_units: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) side by side, from their latencies alone."""
        slow_p, slow_d = self.bandwidth_slowdowns(prefill_bytes / prefill_alone, prefill_units,
                                                  decode_bytes / decode_alone, decode_units)
        fraction = self.pressure_fraction(prefill_tokens, prefill_units)
        decode = decode_alone * slow_d
        if fraction < 1.0:
            decode = max(decode, self.est.decode_time_at_bandwidth(*decode_batch, decode_units, fraction))
        return prefill_alone * max(slow_p, self.prefill_slowdown_factor(decode_units)), decode

    def contention_table(self, decode_units: list[int], typical_context: int = 1024) -> ContentionModel:
        """The tables a profile would hold: decode on u units beside a prefill of sl tokens on the
        other units (bandwidth fraction = the slower of both effects for a memory-bound decode
        step of one request of `typical_context`); prefill's slowdown beside any decode."""
        table = ContentionModel()
        total = self.hardware.units
        for u in decode_units:
            if not 0 < u < total:
                continue
            decode_alone = self.est.decode_time(1, typical_context, u)
            decode_demand = self.decode_bytes(1, typical_context) / decode_alone
            for sl in TABLE_PREFILL_TOKENS:
                prefill_demand = self.prefill_bytes([sl]) / self.est.prefill_time([sl], total - u)
                _, slow_d = self.bandwidth_slowdowns(prefill_demand, total - u, decode_demand, u)
                table.add_bandwidth(u, sl, min(1.0 / slow_d, self.pressure_fraction(sl, total - u)))
        if self.prefill_slowdown > 0:
            table.add_slowdown(1, 1.0 + self.prefill_slowdown)
        return table
