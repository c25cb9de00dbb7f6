"""Runs one configuration of the isolation probe (`sm_probe`): starts the sides' processes
(`sm_probe_child`: one holding both sides, or one each — B first, so that A can take what B was not
granted and the two shares add up to the device), times each probe kind in rounds of A alone, B
alone and both together, judges the spin rates (`sm_probe_verdict`) and replays the spin probe from
CUDA graphs where asked. NVML samples every phase when a sampler is given."""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

from artifact.gpu_check.nvml_sampler import NvmlSampler
from artifact.gpu_check.sm_probe_verdict import judge_graph, judge_spin, kept_by_kind
from bullet.doctor.child import JsonLineChild
from bullet.partition.mps import THREAD_PERCENTAGE_ENV
from bullet.partition.mps_share import percentage_for

KINDS = ("spin", "fma", "copy", "gemm")
SIDES = ("A", "B")
PHASE_S = 0.4  # one timed phase: ~500 spin launches, long beside a side's start-up skew (~1 ms)
ROUNDS = 2


@dataclass(frozen=True)
class Config:
    name: str
    backend: str
    one_process: bool = False
    mps: bool | None = None  # the MPS daemon must run (True) or not (False); None: no MPS (a CPU)
    graph: bool = False
    about: str = ""



class _Runner:
    """The sides' processes: one holding both (one_process) or one each."""

    def __init__(self, config: Config, device: str, total: int, kinds: tuple[str, ...], extra: list[str],
                 env: dict, timeout: float):
        self.timeout = timeout
        self.children: dict[str, JsonLineChild] = {}
        self.ready: dict = {"sides": {}}
        base = [sys.executable, "-m", "artifact.gpu_check.sm_probe_child", "--device", device,
                "--kinds", ",".join(kinds), "--total-units", str(total), *extra]
        half = total // 2
        # A takes what B was granted less than the device; without a partition B is granted every
        # unit, so A asks for the other half instead (and gets every unit too)
        def rest(granted: int) -> int:
            return total - half if config.backend == "none" else total - granted

        try:
            if config.one_process:
                a_units = "rest" if config.backend != "none" else str(rest(total))
                child = self._start("AB", base + ["--side", f"B:{config.backend}:decode:{half}",
                                                  "--side", f"A:{config.backend}:prefill:{a_units}"], env)
                self.children = {"A": child, "B": child}
                self.ready = child.ready
            else:  # B first: A takes what B was not granted, so the shares add up to the device
                b = self._start("B", base + ["--side", f"B:{config.backend}:decode:{half}"],
                                {**env, **self._side_env(config, half, total)})
                units_a = rest(b.ready["sides"]["B"]["units"])
                a = self._start("A", base + ["--side", f"A:{config.backend}:prefill:{units_a}"],
                                {**env, **self._side_env(config, units_a, total)})
                self.children = {"A": a, "B": b}
                self.ready = {"sides": {**a.ready["sides"], **b.ready["sides"]},
                              "kinds": sorted(set(a.ready["kinds"]) & set(b.ready["kinds"])),
                              "unavailable": {**b.ready.get("unavailable", {}), **a.ready.get("unavailable", {})}}
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _side_env(config: Config, units: int, total: int) -> dict:
        if config.backend != "mps-percentage":
            return {}
        return {THREAD_PERCENTAGE_ENV: str(percentage_for(units, total))}

    def _start(self, name: str, cmd: list[str], env: dict) -> JsonLineChild:
        child = JsonLineChild(cmd, timeout=self.timeout, env=env, wait=False)
        self.children.setdefault(name, child)
        answer = child.wait_ready()
        if "error" in answer:
            raise RuntimeError(f"side {name}: {answer['error']}")
        return child

    def run(self, command: str, names: tuple[str, ...], seconds: float) -> dict:
        """`command` ("run KIND" or "graph") for `names` at once; side -> its result."""
        answer_s = seconds + self.timeout
        if len(names) > 1 and self.children[names[0]] is self.children[names[1]]:
            replies = [self.children[names[0]].send(f"{command} {seconds} {','.join(names)}", answer_s)]
        else:
            for n in names:
                self.children[n].post(f"{command} {seconds} {n}")
            replies = [self.children[n].read(answer_s) for n in names]
        out: dict = {}
        for reply in replies:
            if "error" in reply:
                raise RuntimeError(reply["error"])
            out.update(reply["sides"])
        for n in names:
            if "error" in out.get(n, {"error": "no answer"}):
                raise RuntimeError(f"side {n}: {out.get(n, {}).get('error', 'no answer')}")
        return out

    def close(self) -> None:
        for child in {id(c): c for c in self.children.values()}.values():
            child.close()


def measure(config: Config, device: str, total: int, kinds: tuple[str, ...] = KINDS, phase_s: float = PHASE_S,
            rounds: int = ROUNDS, sampler: NvmlSampler | None = None, extra: list[str] | None = None,
            env: dict | None = None, timeout: float = 120.0) -> dict:
    """One configuration: both sides alone and together, `rounds` times per kind; never raises for
    a side that fails (the result's outcome is then "failed", with the error)."""
    sampler = sampler or NvmlSampler(nvml=_NoNvml())
    began = time.monotonic()
    out: dict = {"config": config.name, "about": config.about, "backend": config.backend,
                 "one_process": config.one_process, "mps": config.mps, "phase_s": phase_s, "rounds": rounds}
    runner = None
    try:
        runner = _Runner(config, device, total, kinds, extra or [], dict(os.environ if env is None else env), timeout)
        sides = runner.ready["sides"]
        units = {n: sides[n]["units"] for n in SIDES}
        out.update(units=units, total=total, unit_sets={n: sides[n].get("unit_set") for n in SIDES},
                   unavailable=runner.ready.get("unavailable", {}))
        ran = [k for k in kinds if k in runner.ready.get("kinds", [])]
        rates: dict = {}
        out["rates"] = rates
        for kind in ran:
            try:
                rates[kind] = _measure_kind(runner, sampler, f"{config.name}/{kind}", kind, phase_s, rounds)
            except (RuntimeError, OSError, ValueError, KeyError) as e:  # the other kinds still run
                rates[kind] = {"error": f"{type(e).__name__}: {e}"[:600]}
                continue
            if kind == "spin":
                eff = rates[kind].get("effective_units", {})
                out["verdict"] = judge_spin(rates[kind]["alone"], rates[kind]["together"], units,
                                            effective_alone={n: eff.get(f"alone_{n}") for n in SIDES},
                                            shared_sm_blocks=rates[kind]["shared_sm_blocks"])
        if config.graph and "effective_units" in rates.get("spin", {}):
            out["graph"] = {}
            for n in SIDES:
                try:
                    with sampler.phase(f"{config.name}/spin-graph/alone-{n}"):
                        res = runner.run("graph", (n,), phase_s)[n]
                except (RuntimeError, OSError, ValueError, KeyError) as e:
                    out["graph"][n] = {"outcome": "failed", "summary": f"{type(e).__name__}: {e}"[:600]}
                    continue
                out["graph"][n] = judge_graph(rates["spin"]["effective_units"].get(f"alone_{n}"),
                                              res.get("effective_units"), units[n], total)
        if "verdict" not in out:
            out["verdict"] = {"outcome": "failed", "summary": f"the spin probe did not run ({out['unavailable']})"}
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        out["verdict"] = {"outcome": "failed", "summary": f"{type(e).__name__}: {e}"[:600]}
    finally:
        if runner is not None:
            runner.close()
    out["nvml"] = {label.split("/", 1)[1]: s for label, s in sampler.phases.items()
                   if label.startswith(config.name + "/")}
    out["seconds"] = round(time.monotonic() - began, 1)
    return out


def _measure_kind(runner: _Runner, sampler: NvmlSampler, label: str, kind: str, phase_s: float, rounds: int) -> dict:
    """`rounds` rounds of: each side alone (who goes first alternates), then both together."""
    alone, together = {n: [] for n in SIDES}, {n: [] for n in SIDES}
    effective: dict[str, list[float]] = {f"{w}_{n}": [] for w in ("alone", "together") for n in SIDES}
    unit, shared = None, 0
    for r in range(rounds):
        for n in (SIDES if r % 2 == 0 else SIDES[::-1]):
            with sampler.phase(f"{label}/alone-{n}"):
                res = runner.run(f"run {kind}", (n,), phase_s)[n]
            alone[n].append(res["rate"])
            effective[f"alone_{n}"].append(res.get("effective_units"))
            unit, shared = res["unit"], max(shared, res.get("shared_sm_blocks") or 0)
        with sampler.phase(f"{label}/together"):
            both = runner.run(f"run {kind}", SIDES, phase_s)
        for n in SIDES:
            together[n].append(both[n]["rate"])
            effective[f"together_{n}"].append(both[n].get("effective_units"))
            shared = max(shared, both[n].get("shared_sm_blocks") or 0)
    out = {"unit": unit, "alone": alone, "together": together, "kept": kept_by_kind(alone, together),
           "shared_sm_blocks": shared}
    if any(v is not None for vs in effective.values() for v in vs):
        out["effective_units"] = {k: statistics.median(v) for k, v in effective.items() if v and None not in v}
    return out


class _NoNvml:
    """Stands in for pynvml where nobody asked for sampling (the CPU): every phase says so."""

    def nvmlInit(self):
        raise RuntimeError("not sampled on this device")

