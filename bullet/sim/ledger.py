"""What dividing the device's units gains and what it costs, in device-seconds, accounted by the
simulated device interval by interval (between two starts or ends of a step the configuration is
constant).

The unit of account is the *whole-device second*: a step that would take F seconds alone on every
unit and takes T seconds in the configuration it runs in does F/T whole-device seconds of work per
second (its rate r). So for every interval of length dt:

* one step runs (solo): work r·dt; `solo_loss` (1 − r)·dt is what running on less than the whole
  device cost — a worker left on its share while its partner has nothing to run (or is between
  steps), or a share of units the partition never hands out;
* both run (co-run): work (r_p + r_d)·dt; `corun_gain` (r_p + r_d − 1)·dt is what running them side
  by side bought over running them one after the other on the whole device (negative: it lost). It
  splits into the split's worth, `split_gain` (a_p + a_d − 1)·dt, where a is the rate each step would
  have alone on the units it effectively holds (a decode step on a small share is memory-bound and
  keeps most of its speed: a_d above its share of units), minus `contention_loss`
  ((a_p − r_p) + (a_d − r_d))·dt, what the shared memory system took from both; and `idle_unit_s`,
  units neither step holds × dt (the pool's remainder, shares that do not add up to the device).

So `work = busy − solo_loss + corun_gain` exactly: for the same requests served, a policy whose
device is busy for less time — more headroom for the next request — is one with more corun gain and
less solo loss. `bullet simulate --ledger` prints it; `python -m artifact.partition_ledger` compares
policies on a workload."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Ledger:
    total_units: int
    busy_s: float = 0.0
    corun_s: float = 0.0
    solo_s: dict[str, float] = field(default_factory=dict)
    work_s: dict[str, float] = field(default_factory=dict)  # whole-device seconds of work done, per role
    solo_loss_s: float = 0.0
    corun_gain_s: float = 0.0
    split_gain_s: float = 0.0
    contention_loss_s: float = 0.0
    idle_unit_s: float = 0.0  # unit-seconds no running step held, while any ran
    corun_idle_unit_s: float = 0.0  # ... of them while both ran (shares that do not add up to the device)
    corun_units_s: dict[str, float] = field(default_factory=dict)  # effective units x seconds while co-running

    def solo(self, dt: float, role: str, rate: float, units: float) -> None:
        """`role` ran alone for `dt` at `rate` whole-device seconds per second on `units` units."""
        self.busy_s += dt
        self.solo_s[role] = self.solo_s.get(role, 0.0) + dt
        self.work_s[role] = self.work_s.get(role, 0.0) + rate * dt
        self.solo_loss_s += (1.0 - rate) * dt
        self.idle_unit_s += max(0.0, self.total_units - units) * dt

    def corun(self, dt: float, rates: dict[str, float], alone: dict[str, float], units: dict[str, float]) -> None:
        """Both ran for `dt`: each at `rates[role]`; `alone[role]` the rate it would have had alone on
        its effective `units[role]`."""
        self.busy_s += dt
        self.corun_s += dt
        for role, rate in rates.items():
            self.work_s[role] = self.work_s.get(role, 0.0) + rate * dt
            self.corun_units_s[role] = self.corun_units_s.get(role, 0.0) + units[role] * dt
        self.corun_gain_s += (sum(rates.values()) - 1.0) * dt
        self.split_gain_s += (sum(alone.values()) - 1.0) * dt
        self.contention_loss_s += sum(alone[r] - rates[r] for r in rates) * dt
        idle = max(0.0, self.total_units - sum(units.values())) * dt
        self.idle_unit_s += idle
        self.corun_idle_unit_s += idle

    @property
    def work_total_s(self) -> float:
        return sum(self.work_s.values())

    def as_dict(self) -> dict:
        out = asdict(self)
        out["work_total_s"] = self.work_total_s
        corun = max(self.corun_s, 1e-12)
        out["corun_rate"] = 1.0 + self.corun_gain_s / corun if self.corun_s else None  # whole devices while co-running
        out["mean_corun_units"] = {r: u / corun for r, u in self.corun_units_s.items()} if self.corun_s else {}
        out["idle_unit_fraction"] = self.idle_unit_s / (self.total_units * self.busy_s) if self.busy_s else 0.0
        return out
