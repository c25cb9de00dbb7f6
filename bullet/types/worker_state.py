"""What a worker publishes in the state buffer for its peer and the launcher to read: the record,
its flag bits, and the launcher's control bits. A pure module (no shared memory, no C extension),
so that policies and the simulator can use the record without the runtime.

The binary layout that carries it between processes is in `bullet.shm.state_buffer`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The heartbeat's clock: an idle worker publishes, and the launcher's watchdog looks for a silent one, this
# often — at most a quarter of `--heartbeat-timeout`, so an idle worker is never taken for a hung one.
HEARTBEAT_INTERVAL_S = 1.0


def heartbeat_interval_s(heartbeat_timeout: float) -> float:
    """`HEARTBEAT_INTERVAL_S`, or a quarter of `heartbeat_timeout` where that is shorter (0: no watchdog)."""
    return min(HEARTBEAT_INTERVAL_S, heartbeat_timeout / 4) if heartbeat_timeout > 0 else HEARTBEAT_INTERVAL_S


UNIT_MASK_BITS = 192  # the layout's unit set holds ids 0-191 (an H200's 132 SMs); compute_units counts them all


class WorkerFlags(enum.IntFlag):
    READY = 1 << 0  # model loaded, accepting work
    PAUSED = 1 << 1  # voluntarily idle (e.g. decode yielding units to a prefill burst)
    STOPPED = 1 << 3  # loop exited cleanly
    FAILED = 1 << 4  # loop hit an error it could not handle


class ControlFlags(enum.IntFlag):
    SHUTDOWN = 1 << 0  # workers: stop after the current step


@dataclass(slots=True)
class WorkerState:
    """One worker's published state; `StateBuffer.read` returns a consistent snapshot of it."""

    heartbeat_ns: int = 0  # u64 stamped by publish(): time.monotonic_ns()
    heartbeat_count: int = 0  # u64 stamped by publish(): publishes so far by this role
    pid: int = 0  # u64
    step: int = 0  # u64 steps completed (prefill: layer groups, decode: iterations)
    flags: int = 0  # u64 WorkerFlags
    batch_size: int = 0  # u32 requests in the running batch
    queued_requests: int = 0  # u32 requests waiting
    queued_tokens: int = 0  # u64 prompt tokens waiting
    tokens_in_flight: int = 0  # u64 tokens processed by the current step
    remaining_layers: int = 0  # u32 prefill layers left for the in-flight batch (decode: 0)
    compute_units: int = 0  # u32 current compute share, in units (SMs/TPCs, CPU cores)
    unit_mask_lo: int = 0  # u64 unit set, units 0-63
    unit_mask_hi: int = 0  # u64 unit set, units 64-127
    ttft_pred_p90_ms: float = 0.0  # f64 predicted P90 TTFT of queued + in-flight prefills
    ttft_obs_ms: float = 0.0  # f64 last observed TTFT
    tpot_pred_p90_ms: float = 0.0  # f64 predicted P90 TPOT of the running decode batch
    tpot_obs_ms: float = 0.0  # f64 last observed TPOT
    step_pred_ms: float = 0.0  # f64 predicted latency of the next step
    step_obs_ms: float = 0.0  # f64 observed latency of the last step
    pause_budget_ms: float = 0.0  # f64 decode: pause it can absorb with every request still meeting TPOT
    decisions: int = 0  # u64 scheduling decisions taken so far (for /metrics)
    repartitions: int = 0  # u64 changes of this worker's compute share so far (for /metrics)
    unit_mask_ext: int = 0  # u64 unit set, units 128-191
    # u32 prefill: the share it has chosen when that is more than it runs on (0: none) — it runs beside
    # the units a decode step holds until the step ends, and decode's next step takes the complement
    claimed_units: int = 0
    # u64 decode: requests prefill handed over that it has received so far; prefill counts those it sent
    # beyond this as in flight (they hold a `--max-running-requests` slot that neither batch shows)
    handoffs_seen: int = 0

    @property
    def unit_mask(self) -> int:
        return self.unit_mask_lo | (self.unit_mask_hi << 64) | (self.unit_mask_ext << 128)

    def set_unit_mask(self, mask: int) -> None:
        """Store a unit set given as a bit mask (ids >= 192 do not fit the layout and are dropped;
        compute_units is left to the caller, which knows the full count)."""
        mask &= (1 << UNIT_MASK_BITS) - 1
        word = 2**64 - 1
        self.unit_mask_lo, self.unit_mask_hi, self.unit_mask_ext = mask & word, (mask >> 64) & word, mask >> 128

    def set_units(self, units) -> None:
        """Set the unit set (indices 0-191); compute_units follows its size."""
        mask = 0
        for u in units:
            if not 0 <= u < UNIT_MASK_BITS:
                raise ValueError(f"unit {u} outside 0..{UNIT_MASK_BITS - 1}")
            mask |= 1 << u
        self.set_unit_mask(mask)
        self.compute_units = mask.bit_count()

    def units(self) -> list[int]:
        mask = self.unit_mask
        return [u for u in range(UNIT_MASK_BITS) if mask >> u & 1]


@dataclass
class Predictions:
    """What a policy predicted this step, for its peer to read (the WorkerState fields it sets)."""

    ttft_pred_p90_ms: float = 0.0
    tpot_pred_p90_ms: float = 0.0
    step_pred_ms: float = 0.0
    pause_budget_ms: float = 0.0

    def write_to(self, state: WorkerState) -> None:
        state.ttft_pred_p90_ms, state.tpot_pred_p90_ms = self.ttft_pred_p90_ms, self.tpot_pred_p90_ms
        state.step_pred_ms, state.pause_budget_ms = self.step_pred_ms, self.pause_budget_ms
