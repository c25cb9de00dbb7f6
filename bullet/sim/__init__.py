"""Discrete-event simulator of a Bullet server on a virtual GPU — the third world a
policy runs in, beside real workers on CPU cores and on GPU SMs: the
worker processes' own loop cores (`bullet.loops`) with their real policies and the real
chunked-prefill scheduler, driven on virtual time, with step latencies charged by the estimator.

    from bullet.sim import SimConfig, Simulation
    result = Simulation(SimConfig(policy="bullet"), [(0.0, 1024, 128)]).run()

Modules: `events` (virtual clock, event loop), `device` (what a step costs: units, overlap,
contention, noise), `partition` (the simulated partition backend), `board` (the state buffer),
`executor` (steps on the device), `driver` (a core on virtual time, and where its outputs go),
`metrics`, `config`, `simulator` (one run), `conversations` (multi-turn, closed loop), `report`.
The prefix cache runs here as in a worker (`SimConfig.radix_cache`): the same `bullet.cache`."""

from bullet.sim.config import SimConfig
from bullet.sim.metrics import RequestRecord, summarize
from bullet.sim.simulator import SimResult, Simulation

__all__ = ["RequestRecord", "SimConfig", "SimResult", "Simulation", "summarize"]
