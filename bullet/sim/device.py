"""The simulated accelerator: charges every step the latency the estimator gives for it, at the units
its worker holds, beside whatever the other worker is running at that moment.

A step is a fixed amount of work (1.0) done at a rate of 1 / (its latency in the current
configuration). The configuration changes whenever either worker starts or ends a step (the two run
asynchronously, as on the real device), and then every running step's rate is recomputed and its end
re-scheduled — so a decode step that starts beside a long prefill layer group and finishes alone is
charged partly at each speed. Within one configuration:

* units: each worker gets its granted share (`SimulatedPartition.current_units`). When the shares
  sum above the total (Bullet's hand-over, a stale peer state, or `naive`, where both hold
  everything) the overlapping units are *shared*: they go to the two workers in proportion to the
  thread blocks each keeps in flight, approximated by GEMM tile rows (ceil(rows / 128)) — a large
  prefill crowds a small decode batch off the shared units, as a first-come block scheduler would
  (`overlap_share="even"` splits them half and half instead). On a CPU (`overlap_share=
  "time-sliced"`, the simulator's choice for a device whose units are cores) no block scheduler
  divides a core: the OS time-slices the threads that hold it, and a step of several OpenMP threads
  waits at every barrier for the one that was descheduled. Such a step, on two or more cores of
  which the other worker's threads hold any, takes `oversubscribed_slowdown` times its time alone on
  its cores (measured served, `CPU_OVERSUBSCRIBED_SLOWDOWN`); a one-thread step has no barrier to
  wait at and is priced as a co-run on its own core. On a GPU whose profile timed each phase on every
  SM beside the other on every SM (`overlap_share="measured"`, `shared_slowdowns`), a step on SMs the
  other worker holds too takes that phase's measured factor times its time alone on its SMs, in
  place of the demand split (which divides the SMs by demand, for free: an assumption).
* memory contention (units isolated, memory system shared): one HBM divided between the two
  steps' demands, and interference beyond bandwidth, from `estimator.analytic_contention` (an
  assumed model; off with `contention=None`) — or, for a device whose profile timed each phase
  beside the other (`measured_corun`), the estimator's measured table: decode's bandwidth beside a
  prefill of that many tokens, prefill's slowdown beside a decode batch of that size.
* noise: each step's latency is multiplied by a seeded factor drawn uniformly from [1-n, 1+n]
  (Bullet §3.2.3 measures 95 % of co-running latencies within ±6.8 % of their mean).
* co-run scale: a step that runs beside the other worker's takes `corun_scale` times what the model
  above prices (1.0: as profiled) — a what-if for shares that hold each other back more than the
  profile's co-runs measured (> 1: SMs shared that the partition says are not, power or L2 limits)
  or less (< 1), charged to every system whose two workers run at once (`SimConfig.corun_scale`).
* time scale: and by `time_scale` (1.0: the device model as profiled) — a served machine that ran
  its steps slower than its profile, as its step log measured (`SimConfig.step_time_scale`).

* overhead: `step_overhead_s` after every step's kernels, for every system alike — launching the
  step and the scheduler's bookkeeping, time in which the worker is busy but its units are not.
* per role: `role_step_times[role] = (scale, overhead_s)` replaces the time scale and the overhead
  for that worker's steps (a served run whose prefill worker ran further off the profile than its
  decode worker, `SimConfig.role_step_times`)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from bullet.sim.events import EventLoop
from bullet.sim.ledger import Ledger
from bullet.sim.partition import overlap
from estimator.analytic_contention import AnalyticContention
from estimator.estimator import Estimator
from estimator.tiling import TABLE2_GEMM_TILE

TILE_ROWS = TABLE2_GEMM_TILE[0]
OVERLAP_SHARES = ("demand", "even", "time-sliced", "measured")  # how overlapping units are divided (module docstring)
# A step of two or more threads on cores that the other worker's threads also held, against the same step
# alone on its cores: measured served on 2 cores of an AMD EPYC (avx512_bf16, no AMX), 2026-12-01, from the
# `naive` and `scheduler-only` servers' step timelines (`python -m artifact.served_corun --oversubscribed`;
# docs/served/amd-2026-12-01-ablation): the median over the 2,505 steps that spent >= 90 % of their span so,
# each over its role's and share's median alone (prefill 5.7x, decode 8.8x). Fair time slicing alone would
# give 2x; the rest is OpenMP barriers waiting for a descheduled thread. The value for a CPU whose own
# served run measured none; `SimConfig.oversubscribed_slowdown` replaces it.
CPU_OVERSUBSCRIBED_SLOWDOWN = 7.4


@dataclass(frozen=True)
class PrefillWork:
    """Layers of a packed prefill (the head too when this group finishes the batch)."""

    seq_lens: tuple[int, ...]
    layers: int
    include_head: bool
    cached: tuple[int, ...] = ()  # tokens of each sequence already in the pool (a prefix cache hit)

    @property
    def rows(self) -> int:
        return sum(self.seq_lens)


@dataclass(frozen=True)
class DecodeWork:
    """One decode iteration of `batch` requests holding `context` KV tokens in all."""

    batch: int
    context: int

    @property
    def rows(self) -> int:
        return self.batch


@dataclass(frozen=True)
class HybridWork:
    """One hybrid step of the chunked baseline: (new tokens, cached prefix) chunks plus decodes."""

    chunks: tuple[tuple[int, int], ...]
    batch: int
    context: int

    @property
    def rows(self) -> int:
        return sum(c for c, _ in self.chunks) + self.batch


@dataclass(slots=True)
class Step:
    role: str
    work: PrefillWork | DecodeWork | HybridWork
    units: int
    noise: float
    on_done: Callable[[float], None]
    started: float
    last: float = 0.0  # when progress was last brought up to date
    progress: float = 0.0  # fraction of the work done
    seconds: float = 0.0  # latency of the whole step in the current configuration
    version: int = 0  # bumps when the end is re-scheduled; older end events are stale
    # what a step's work fixes, computed when first asked (the configuration changes at every start
    # and end of either worker's step, and each change re-rates every running step): thread-block
    # weight, memory traffic, latency alone by units and co-running by (units, the other's load)
    rows: int = 0
    weight: int = 0
    traffic: float = -1.0
    latency: dict = field(default_factory=dict)
    # a step that runs layer by layer (a decode step on a CPU): its layers, and what it does at a layer
    # boundary once the other worker's step has started on units it holds (`SimulatedDevice.start`)
    layers: int = 0
    at_layer: Callable[[int], None] | None = None

    def __post_init__(self):
        self.rows = self.work.rows
        self.weight = max(1, -(-self.rows // TILE_ROWS))


@dataclass
class DeviceStats:
    steps: dict[str, int] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)
    corun_s: float = 0.0  # time with both workers running a step
    overlap_unit_s: float = 0.0  # shared-unit seconds while both ran on overlapping shares


class SimulatedDevice:
    def __init__(self, estimator: Estimator, loop: EventLoop, contention: AnalyticContention | None = None,
                 noise: float = 0.0, seed: int = 0, overlap_share: str = "demand", step_overhead_s: float = 0.0,
                 measured_corun: bool = False, time_scale: float = 1.0,
                 role_step_times: dict[str, tuple[float, float]] | None = None, ledger: bool = False,
                 corun_scale: float = 1.0, oversubscribed_slowdown: float = CPU_OVERSUBSCRIBED_SLOWDOWN,
                 shared_slowdowns: dict[str, float] | None = None):
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must lie in [0, 1), got {noise}")
        if not time_scale > 0:
            raise ValueError(f"step_time_scale (--step-time-scale) must be positive, got {time_scale}")
        if not corun_scale > 0:
            raise ValueError(f"corun_scale (--corun-scale) must be positive, got {corun_scale}")
        role_step_times = {role: (float(scale), float(overhead)) for role, (scale, overhead) in (role_step_times or {}).items()}
        for role, (scale, overhead) in role_step_times.items():
            if not scale > 0 or overhead < 0:
                raise ValueError(f"role_step_times[{role!r}]: the scale must be positive and the overhead at least 0, "
                                 f"got {scale}, {overhead}")
        if overlap_share not in OVERLAP_SHARES:
            raise ValueError(f"overlap_share must be one of {OVERLAP_SHARES}, got {overlap_share!r}")
        if not oversubscribed_slowdown >= 1.0:
            raise ValueError(f"oversubscribed_slowdown (--oversubscribed-slowdown) must be at least 1, "
                             f"got {oversubscribed_slowdown}")
        self.oversubscribed_slowdown = oversubscribed_slowdown
        if overlap_share == "measured" and not (shared_slowdowns and {"prefill", "decode"} <= shared_slowdowns.keys()):
            raise ValueError("overlap_share 'measured' needs shared_slowdowns for prefill and decode")
        # time-sliced: one factor for both phases; measured: each phase's own
        self.shared_slowdowns = (dict(shared_slowdowns) if overlap_share == "measured" else
                                 {"prefill": oversubscribed_slowdown, "decode": oversubscribed_slowdown})
        self.est, self.loop, self.contention, self.noise = estimator, loop, contention, noise
        self.overlap_share, self.step_overhead_s = overlap_share, step_overhead_s
        self.measured_corun, self.time_scale, self.corun_scale = measured_corun, time_scale, corun_scale
        self.role_step_times = role_step_times
        self.total = estimator.hardware.units
        self.rng = random.Random(seed)
        self.running: dict[str, Step] = {}
        self.stats = DeviceStats()
        self._last_account = 0.0
        # what the split gains and costs, interval by interval (`bullet.sim.ledger`; off: it prices every
        # running step on every unit too)
        self.ledger = Ledger(self.total) if ledger else None

    def start(self, role: str, work, units: int, on_done: Callable[[float], None], layers: int = 0,
              at_layer: Callable[[int], None] | None = None) -> None:
        """Run `work` for `role` on `units` units; `on_done(elapsed)` at its end. A step of `layers`
        layers with `at_layer` runs layer by layer: when the other worker's step starts on units it
        holds, `at_layer(layers done)` runs at its next layer boundary (it may `resize` the step), as
        the real decode worker's step checks its share between layers."""
        if role in self.running:
            raise RuntimeError(f"{role} already has a step running")
        if not 0 < units <= self.total:
            raise ValueError(f"units must lie in 1..{self.total}, got {units}")
        now = self.loop.clock.now()
        factor = 1.0 + self.noise * (2.0 * self.rng.random() - 1.0) if self.noise else 1.0
        # x 1.0 is x, to the bit: an unscaled device charges what it did
        factor *= self.role_step_times[role][0] if role in self.role_step_times else self.time_scale
        self._account(now)
        self.running[role] = Step(role, work, units, factor, on_done, started=now, last=now, layers=layers,
                                  at_layer=at_layer)
        self._rebalance(now)
        other = self.running.get("decode" if role == "prefill" else "prefill")
        if other is not None and other.at_layer is not None and overlap(
                *((units, other.units) if role == "prefill" else (other.units, units)), self.total):
            done = int(other.progress * other.layers + 1e-9)  # whole layers behind it
            if done + 1 < other.layers:  # a boundary is left before its last layer ends
                self.loop.at(now + ((done + 1) / other.layers - other.progress) * other.seconds,
                             self._layer_boundary, other, done + 1)

    def resize(self, role: str, units: int) -> None:
        """The running step of `role` goes on with `units` units from now (a share given up between layers)."""
        step = self.running.get(role)
        if step is None or units == step.units:
            return
        if not 0 < units <= self.total:
            raise ValueError(f"units must lie in 1..{self.total}, got {units}")
        now = self.loop.clock.now()
        self._account(now)
        step.units = units
        self._rebalance(now)

    def _layer_boundary(self, step: Step, layers_done: int) -> None:
        if self.running.get(step.role) is step:  # not ended since
            step.at_layer(layers_done)

    # -- the configuration changed: bring progress up to date, re-rate, re-schedule ends ---------------
    def _rebalance(self, now: float) -> None:
        steps = list(self.running.values())
        for step in steps:
            if step.seconds:
                step.progress += (now - step.last) / step.seconds
            step.last = now
        prefill, decode = self.running.get("prefill"), self.running.get("decode")
        if len(steps) == 1:
            latencies = (self._step_alone(steps[0], min(self.total, max(1, steps[0].units))),)
        elif len(steps) == 2 and prefill is not None and decode is not None:
            latencies = self._pair(prefill, decode)
            if steps[0] is decode:  # in the order they started (the order their ends are scheduled in)
                latencies = latencies[::-1]
        else:
            by_role = self.latencies()
            latencies = tuple(by_role[step.role] for step in steps)
        for step, latency in zip(steps, latencies):
            seconds = latency * step.noise
            if seconds != step.seconds:
                step.seconds = seconds
                step.version += 1
                remaining = max(0.0, 1.0 - step.progress) * seconds
                self.loop.at(now + remaining, self._finish, step, step.version)

    def _finish(self, step: Step, version: int) -> None:
        if version != step.version or self.running.get(step.role) is not step:
            return  # re-scheduled since
        now = self.loop.clock.now()
        self._account(now)
        del self.running[step.role]
        self._rebalance(now)
        stats = self.stats
        stats.steps[step.role] = stats.steps.get(step.role, 0) + 1
        stats.busy_s[step.role] = stats.busy_s.get(step.role, 0.0) + (now - step.started)
        overhead = self.role_step_times[step.role][1] if step.role in self.role_step_times else self.step_overhead_s
        if overhead > 0:
            self.loop.at(now + overhead, step.on_done, now - step.started + overhead)
        else:
            step.on_done(now - step.started)

    def sharing(self) -> str:
        """How a step on units both workers hold is priced, in words (a run's summary says it)."""
        if self.overlap_share == "measured":
            return ("priced by phase: " + ", ".join(f"{role} {self.shared_slowdowns[role]:.2f}x"
                                                    for role in ("prefill", "decode")) + " its time alone")
        if self.overlap_share == "time-sliced":
            return f"time-sliced: a step of several threads {self.oversubscribed_slowdown:.2f}x its time alone"
        if self.overlap_share == "even":
            return "split evenly (assumed)"
        return "split by demand, thread-block rows (assumed, free)"

    def effective_units(self) -> dict[str, float]:
        """Units each running step effectively computes on, overlapping units shared."""
        units = {role: float(s.units) for role, s in self.running.items()}
        prefill, decode = self.running.get("prefill"), self.running.get("decode")
        if prefill is not None and decode is not None:
            shared = overlap(prefill.units, decode.units, self.total)
            if shared:
                wp, wd = (prefill.weight, decode.weight) if self.overlap_share == "demand" else (1, 1)
                units["prefill"] -= shared * wd / (wp + wd)
                units["decode"] -= shared * wp / (wp + wd)
        return units

    def latencies(self) -> dict[str, float]:
        """Latency of each running step, whole, in the current configuration (before noise)."""
        if len(self.running) == 1:  # alone: its own units, no one to share them or memory with
            (role, step), = self.running.items()
            return {role: self._step_alone(step, min(self.total, max(1, round(float(step.units)))))}
        prefill, decode = self.running.get("prefill"), self.running.get("decode")
        if len(self.running) == 2 and prefill is not None and decode is not None:
            return dict(zip(("prefill", "decode"), self._pair(prefill, decode)))
        units = {role: min(self.total, max(1, round(u))) for role, u in self.effective_units().items()}
        return {role: self._step_alone(step, units[role]) for role, step in self.running.items()}

    def _pair(self, prefill: Step, decode: Step) -> tuple[float, float]:
        """(prefill, decode) latencies side by side, x `corun_scale` (1.0: the device model's own)."""
        p, d = self._pair_priced(prefill, decode)
        return (p, d) if self.corun_scale == 1.0 else (p * self.corun_scale, d * self.corun_scale)

    def _pair_priced(self, prefill: Step, decode: Step) -> tuple[float, float]:
        """(prefill, decode) latencies side by side: `effective_units` and the contention model,
        without the dictionaries (every start and end of a step while the other runs asks)."""
        total = self.total
        units_p, units_d = float(prefill.units), float(decode.units)
        shared = overlap(prefill.units, decode.units, total)
        if shared and self.overlap_share in ("time-sliced", "measured"):
            return self._time_sliced(prefill, decode)
        if shared:
            wp, wd = (prefill.weight, decode.weight) if self.overlap_share == "demand" else (1, 1)
            units_p -= shared * wd / (wp + wd)
            units_d -= shared * wp / (wp + wd)
        up, ud = min(total, max(1, round(units_p))), min(total, max(1, round(units_d)))
        if self.measured_corun:
            return self._corun_prefill(prefill, up, decode.work.batch), self._corun_decode(decode, ud, prefill.rows)
        alone_p, alone_d = self._step_alone(prefill, up), self._step_alone(decode, ud)
        c = self.contention
        if c is None:
            return alone_p, alone_d
        d = decode.work
        return c.corun(alone_p, self._traffic(prefill), prefill.rows, units_p,
                       alone_d, self._traffic(decode), (d.batch, d.context), ud)

    def _time_sliced(self, prefill: Step, decode: Step) -> tuple[float, float]:
        """(prefill, decode) latencies on cores both hold (module docstring): a step of several threads
        its phase's `shared_slowdowns` x its time alone on its cores; a one-thread step as a co-run on its
        core beside the other on the rest."""
        slow, total = self.shared_slowdowns, self.total
        p = (self._step_alone(prefill, prefill.units) * slow["prefill"] if prefill.units > 1 else
             self._corun_one_core(prefill, decode, total))
        d = (self._step_alone(decode, decode.units) * slow["decode"] if decode.units > 1 else
             self._corun_one_core(decode, prefill, total))
        return p, d

    def _corun_one_core(self, step: Step, other: Step, total: int) -> float:
        """A one-core step beside the other worker's on the remaining cores (its co-run price)."""
        if total < 2:  # one core, one thread each: the OS's fair time slices, no barrier
            return self._step_alone(step, 1) * 2.0
        if self.measured_corun:
            return (self._corun_prefill(step, 1, other.work.batch) if step.role == "prefill"
                    else self._corun_decode(step, 1, other.rows))
        return self._step_alone(step, 1)

    def _step_alone(self, step: Step, units: int) -> float:
        seconds = step.latency.get(units)
        if seconds is None:
            seconds = step.latency[units] = self._alone(step.work, units)
        return seconds

    def _alone(self, work, units: int) -> float:
        if isinstance(work, PrefillWork):
            return self.est.prefill_time(list(work.seq_lens), units, num_layers=work.layers,
                                         include_head=work.include_head, cached=list(work.cached) or None)
        if isinstance(work, DecodeWork):
            return self.est.decode_time(work.batch, work.context, units)
        return self.est.hybrid_step_time(list(work.chunks), work.batch, work.context, units)

    def _corun_prefill(self, step: Step, units: int, decode_batch: int) -> float:
        """The measured co-running table's prefill latency beside a decode batch (`measured_corun`)."""
        key = (units, decode_batch)
        seconds = step.latency.get(key)
        if seconds is None:
            p = step.work
            seconds = step.latency[key] = self.est.prefill_time(
                list(p.seq_lens), units, num_layers=p.layers, include_head=p.include_head,
                co_decode_batch=decode_batch, cached=list(p.cached) or None)
        return seconds

    def _corun_decode(self, step: Step, units: int, prefill_tokens: int) -> float:
        key = (units, prefill_tokens)
        seconds = step.latency.get(key)
        if seconds is None:
            d = step.work
            seconds = step.latency[key] = self.est.decode_time(d.batch, d.context, units, co_prefill_tokens=prefill_tokens)
        return seconds

    def _traffic(self, step: Step) -> float:
        """Bytes the step moves (the analytic contention model's demand)."""
        if step.traffic < 0:
            w, c = step.work, self.contention
            step.traffic = (c.prefill_bytes(w.seq_lens, w.layers, w.include_head) if isinstance(w, PrefillWork)
                            else c.decode_bytes(w.batch, w.context))
        return step.traffic

    def _account(self, now: float) -> None:
        """Co-running time since the last change (the configuration was constant over it)."""
        dt = now - self._last_account
        self._last_account = now
        prefill, decode = self.running.get("prefill"), self.running.get("decode")
        if dt > 0 and prefill is not None and decode is not None:
            self.stats.corun_s += dt
            self.stats.overlap_unit_s += dt * overlap(prefill.units, decode.units, self.total)
        if self.ledger is not None and dt > 0 and self.running:
            self._ledger_interval(dt)

    def _ledger_interval(self, dt: float) -> None:
        """Book the interval that just ended (the configuration `running` held throughout it)."""
        total = self.total
        rates = {role: self._step_alone(step, total) * step.noise / step.seconds
                 for role, step in self.running.items() if step.seconds > 0}
        if len(self.running) == 1:
            (role, step), = self.running.items()
            if role in rates:
                self.ledger.solo(dt, role, rates[role], min(total, step.units))
            return
        units = self.effective_units()
        alone = {role: self._step_alone(step, total) / self._step_alone(step, min(total, max(1, round(units[role]))))
                 for role, step in self.running.items()}
        self.ledger.corun(dt, rates, alone, units)
