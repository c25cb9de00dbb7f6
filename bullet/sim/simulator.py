"""A whole simulated server: the workers `--policy` asks for (two for bullet/static/naive, one for
chunked — `factory.roles_for`, as the launcher decides), on one simulated device, one KV pool, one
state buffer, fed a list of requests at their arrival times on virtual time. Each worker is the
same loop core a worker process runs (`bullet.loops.factory.build_core`), driven on virtual time.

    sim = Simulation(SimConfig(policy="bullet", ttft_slo="1.5ms/token", tpot_slo="200ms"), requests)
    result = sim.run()
    result.summary["attainment"], result.records, result.device

The policies get their own estimator objects (each real worker loads its own and refines it
online); the device charges latencies from a separate one that nothing refines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from bullet.loops.base import LoopEnv
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline
from bullet.policies.factory import initial_units, roles_for, slo_of
from bullet.shm.page_allocator import LocalPageAllocator
from bullet.sim.board import StateBoard
from bullet.types.finish import FinishChecker
from bullet.types.request import Request
from bullet.types.roles import Role
from bullet.sim.config import (
    SimConfig,
    device_estimator,
    kv_pool_pages,
    measured_contention,
    overlap_share,
    oversubscribed_slowdown,
    policy_estimator,
    server_args,
    shared_slowdowns,
    step_overhead,
)
from bullet.sim.device import DeviceStats, SimulatedDevice
from bullet.sim.driver import SimDriver, SimOutbox
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.executor import SimExecutor
from bullet.sim.metrics import RequestLog, RequestRecord, summarize
from bullet.sim.partition import SimulatedPartition
from engines.sampling_params import SamplingParams


@dataclass
class SimResult:
    config: SimConfig
    records: list[RequestRecord]
    summary: dict
    device: DeviceStats
    end_time: float  # virtual seconds
    wall_s: float
    events: int
    stopped_early: bool
    counters: dict = field(default_factory=dict)


class Simulation:
    def __init__(self, config: SimConfig, requests: Iterable[Sequence]):
        """`requests`: (arrival s, prompt tokens, output tokens) each, e.g. `TraceRequest`s; or
        (arrival, prompt, output, prefix id, prefix tokens) for requests whose prompts begin with a
        prefix that others share (the same id, the same tokens)."""
        self.config = config
        rows = sorted((float(r[0]), int(r[1]), max(1, int(r[2])), *r[3:5]) for r in requests)
        self.requests = [r[:3] for r in rows]
        self.prefixes = {i: (int(r[3]), int(r[4])) for i, r in enumerate(rows) if len(r) == 5}
        self.device_estimator = device_estimator(config)
        model, hardware = self.device_estimator.model, self.device_estimator.hardware
        pages = kv_pool_pages(config, model, hardware)
        self.args = server_args(config, pages)
        self.slo = slo_of(self.args)
        self.clock = VirtualClock()
        self.loop = EventLoop(self.clock)
        self.device = SimulatedDevice(self.device_estimator, self.loop, config.contention(self.device_estimator),
                                      config.noise, config.seed, overlap_share(config, self.device_estimator),
                                      step_overhead(config, self.device_estimator),
                                      measured_corun=config.contention_model and measured_contention(self.device_estimator),
                                      time_scale=config.step_time_scale, role_step_times=config.role_step_times,
                                      ledger=config.ledger, corun_scale=config.corun_scale,
                                      oversubscribed_slowdown=oversubscribed_slowdown(config, self.device_estimator),
                                      shared_slowdowns=shared_slowdowns(config, self.device_estimator))
        self.log = RequestLog()
        self.board = StateBoard(self.clock)
        self.allocator = LocalPageAllocator(pages, config.page_size)
        self.finish = FinishChecker(None, set(model.eos_token_ids), model.max_position_embeddings)
        self.drivers = self._build_workers()
        self.entry = self.drivers[0]
        self._params: dict[int, SamplingParams] = {}
        self.stopped_early = False
        self._scored = self._finished_misses = 0

    def _build_workers(self) -> list[SimDriver]:
        """Drivers of the workers, the one taking arrivals first (prefill, or the unified worker)."""
        roles = roles_for(self.args)
        hardware = self.device_estimator.hardware
        start = dict(zip((Role.PREFILL, Role.DECODE), initial_units(self.args, hardware.units)))
        drivers: dict[Role, SimDriver] = {}
        for role in reversed(roles):  # decode first: prefill hands off to it
            partition = SimulatedPartition(role.partition_side, hardware)
            partition.apply(start.get(role, hardware.units))
            # the driver (built below, around the core) goes round again once the core has taken a step's end
            executor = SimExecutor(role, self.device, partition, self.clock, self.finish,
                                   on_step_end=drivers_step_ended(drivers, role), token_times=self.log.token_times,
                                   loop=self.loop, attention_setup_s=self.config.attention_setup_s,
                                   layerwise_decode=hardware.kind == "cpu",
                                   num_layers=self.device_estimator.model.num_hidden_layers)
            outbox = SimOutbox(self.log, self.loop, drivers, self.config.handoff_delay_s)
            env = LoopEnv(role=role, clock=self.clock, state=self.board, allocator=self.allocator, partition=partition,
                          timeline=Timeline(self.config.timeline_dir, role.value), executor=executor, outbox=outbox)
            predictor = limit = None
            if self.args.uses_estimator:
                predictor = policy_estimator(self.config, self.device_estimator, role.value)
                limit = self.config.batch_token_limit(self.device_estimator)
            core = build_core(env, self.args, self.device_estimator.model.num_hidden_layers, predictor, limit)
            driver = SimDriver(core, self.loop, self.board)
            core.publish()
            drivers[role] = driver
        return [drivers[role] for role in roles]

    # -- arrivals ---------------------------------------------------------------------------------
    def _arrive(self, index: int) -> None:
        arrival, prompt, output = self.requests[index]
        params = self._params.get(output)
        if params is None:  # shared by requests of one output length: nothing mutates it
            params = self._params[output] = SamplingParams(max_new_tokens=output, ignore_eos=True, temperature=0.0)
        req = Request(rid=f"r{index}", prompt_ids=self._prompt_ids(index, prompt), params=params, uid=index + 1,
                      arrival=arrival)
        self.entry.deliver(req)

    def _schedule_arrivals(self) -> None:
        """Every request at its arrival time (a closed-loop workload schedules later ones as earlier
        ones finish: `bullet.sim.conversations`)."""
        self.loop.at_each((arrival, self._arrive, (i,)) for i, (arrival, _, _) in enumerate(self.requests))

    def _prompt_ids(self, index: int, length: int) -> list[int]:
        """Token ids for the prefix cache to compare: a request's own unless its workload says which
        prefix it shares (`prefixes[index]`: (prefix id, prefix length))."""
        shared = self.prefixes.get(index)
        if shared is None:
            return [index + 1] * length  # no two requests share a page
        key, n = shared
        n = min(n, length)
        return [-(key + 1)] * n + [index + 1] * (length - n)

    # -- running ----------------------------------------------------------------------------------
    def run(self, progress: Callable[[dict], None] | None = None, progress_every_s: float = 30.0) -> SimResult:
        """Run to completion (every request finished), or until `stop_below_attainment` is out of
        reach. `progress(info)` is called every `progress_every_s` virtual seconds."""
        t0 = time.perf_counter()
        self._schedule_arrivals()
        if self.requests:
            self.loop.at(0.0, self._tick, progress, progress_every_s, 0.0, t0)
        self.loop.run()
        for driver in self.drivers:
            driver.core.env.timeline.flush()
        # the run ends with its last request (a progress tick may have moved the clock past it)
        end = self.clock.now() if self.stopped_early else max((r.finish_time for r in self.log.records), default=0.0)
        summary = summarize(self.log.records, self.slo, end, total_requests=len(self.requests))
        counters = {"free_pages": self.allocator.num_free(), "total_pages": self.allocator.total_pages,
                    "steps": {d.core.role.value: d.core.steps for d in self.drivers}}
        for d in self.drivers:
            counters.update(d.core.counters())
        if self.device.ledger is not None:
            counters["ledger"] = self.device.ledger.as_dict()
        if self.config.attention_setup_s:  # per-shape plans the workers built (SimExecutor.setup_for)
            counters["attention_setups"] = sum(d.core.env.executor.setups for d in self.drivers)
        return SimResult(self.config, self.log.records, summary, self.device.stats, end, time.perf_counter() - t0,
                         self.loop.processed, self.stopped_early, counters)

    def _tick(self, progress, every: float, next_report: float, t0: float) -> None:
        """Once per virtual second: report progress when due; stop a run that can no longer reach
        `stop_below_attainment`; notice a simulator that has stalled with work left."""
        if len(self.log.records) >= len(self.requests):
            return
        if len(self.loop) == 0:
            raise RuntimeError(f"simulation stalled at t={self.clock.now():.3f}s with "
                               f"{len(self.requests) - len(self.log.records)} requests unfinished")
        now = self.clock.now()
        if progress is not None and now >= next_report:
            progress({"t": now, "horizon": self.requests[-1][0], "finished": len(self.log.records),
                      "requests": len(self.requests), "wall_s": time.perf_counter() - t0})
            next_report = now + every
        floor = self.config.stop_below_attainment
        if floor is not None and self._certain_misses(now) > (1.0 - floor) * len(self.requests):
            self.stopped_early = True
            self.loop.stop()
            return
        self.loop.at(now + 1.0, self._tick, progress, every, next_report, t0)

    def _certain_misses(self, now: float) -> int:
        """Requests that miss their SLO whatever happens next: finished and missed, or still without
        a first token past their TTFT target."""
        slo, records = self.slo, self.log.records
        for r in records[self._scored:]:
            if not (r.ok and slo.attained(r.input_len, r.ttft, r.tpot, r.tbt_p99)):
                self._finished_misses += 1
        self._scored = len(records)
        late = sum(1 for d in self.drivers for r in d.core.pending_first_token() + d.pending_arrivals()
                   if now - r.arrival > slo.ttft_target(len(r.prompt_ids)))
        return self._finished_misses + late


def drivers_step_ended(drivers: dict[Role, SimDriver], role: Role) -> Callable[[], None]:
    """`role`'s driver's `step_ended`, looked up when a step ends (the driver is built after its executor)."""
    return lambda: drivers[role].step_ended()
