"""A process of the isolation probe: it holds one share (or two, for the one-process configuration)
the way a worker does — the same partition backend, opened by `open_worker_partition` — and runs a
probe workload on it when told to.

    python -m artifact.gpu_check.sm_probe_child --device cuda --side B:green-ctx:decode:66 \
        --side A:green-ctx:prefill:rest --kinds spin,fma,copy,gemm

`--side NAME:BACKEND:ROLE:UNITS` (UNITS "rest": the device's units less those granted to the sides
before it). Commands on stdin, one JSON answer a line on stdout:

    (at start)                 -> {"ready": true, "sides": {NAME: {"units", "total", ...}}, "kinds": [...],
                                   "unavailable": {KIND: why}}
    run KIND SECONDS NAME[,NAME] -> {"sides": {NAME: {"count", "seconds", "rate", "unit", ...}}}: the named
                                   sides run KIND for SECONDS at once (threads of this process)
    graph SECONDS NAME          -> the spin probe replayed from a CUDA graph captured on NAME's stream
    quit

Between commands nothing is launched, so another process can be timed alone. A start-up failure
answers {"error": "..."} instead of ready."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import dataclass, field

from artifact.gpu_check import sm_probe_loops as loops
from artifact.gpu_check.sm_probe_kernels import load_for_current_device
from bullet.partition import BACKENDS, PartitionUnavailable, parse_id_list

KINDS = ("spin", "fma", "copy", "gemm")


def _reply(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


@dataclass
class SideSpec:
    name: str
    backend: str
    role: str
    units: str  # a count, or "rest"

    @classmethod
    def parse(cls, text: str) -> "SideSpec":
        parts = text.split(":")
        if len(parts) != 4 or parts[2] not in ("prefill", "decode") or not (parts[3].isdigit() or parts[3] == "rest"):
            raise ValueError(f"--side wants NAME:BACKEND:ROLE:UNITS (ROLE prefill|decode, UNITS n|rest), got {text!r}")
        if parts[1] not in BACKENDS:
            raise ValueError(f"unknown partition backend {parts[1]!r}; choose from {', '.join(BACKENDS)}")
        return cls(*parts)


@dataclass
class Side:
    spec: SideSpec
    backend: object
    stream: object  # WorkerStream
    loops: dict = field(default_factory=dict)

    def handle(self) -> int:
        return self.stream.handle()

    def close(self) -> None:
        for loop in self.loops.values():
            getattr(loop, "close", lambda: None)()
        self.loops.clear()
        self.backend.close()


def _options(backend: str, args, units: int) -> dict:
    if backend == "cpu":
        return {"cores": sorted(parse_id_list(args.cores))}
    if backend == "green-ctx":
        return {"counts": [units]}  # one pool entry (and the whole device): little memory
    if backend == "libsmctrl":
        return {"library": args.library, "allow_untested_driver": args.allow_untested_driver}
    if backend == "mps-percentage" and args.total_units:
        return {"total_units": args.total_units}
    return {}


def _make_loop(kind: str, side: Side, torch, device, kernels, graph: bool = False):
    units = side.backend.current_units
    if device.type == "cpu":
        if kind == "spin":
            return loops.CpuSpinLoop(side.backend.unit_set())
        if kind == "copy":
            return loops.TorchCopyLoop(torch)
        if kind == "gemm":
            from bullet.doctor.isolation_child import GemmLoop  # deferred: it imports torch

            return GemmLoop(torch, device, side.stream, 192)
        raise ValueError(f"{kind}: a GPU probe (no CPU counterpart)")
    with side.stream.step():  # allocations and warm-up launches on the share's stream
        if kind == "spin":
            return loops.SpinLoop(kernels, torch, side.handle, units, graph=graph)
        if kind == "fma":
            return loops.FmaLoop(kernels, torch, side.handle, units)
        if kind == "copy":
            return loops.CopyLoop(kernels, torch, side.handle, units)
        if kind == "gemm":
            from bullet.doctor.isolation_child import GemmLoop  # deferred: it imports torch

            return GemmLoop(torch, device, side.stream, 4096)
    raise ValueError(f"unknown probe kind {kind!r}")


def _run_together(sides: list[Side], key: str, seconds: float) -> dict:
    """Run each side's loop `key` for `seconds`, all at once (one thread each)."""
    out: dict = {}

    def one(side: Side) -> None:
        try:
            out[side.spec.name] = side.loops[key].run(seconds)
        except Exception as e:  # a side's failure is its answer, not the process's end
            out[side.spec.name] = {"error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=one, args=(s,)) for s in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", action="append", required=True, help="NAME:BACKEND:ROLE:UNITS (repeatable)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--cores", help="cpu backend: the cores it divides (default: the affinity at start)")
    parser.add_argument("--library", help="libsmctrl.so (default: $BULLET_LIBSMCTRL)")
    parser.add_argument("--allow-untested-driver", action="store_true")
    parser.add_argument("--total-units", type=int, default=0,
                        help="the device's SMs as an uncapped process counts them (mps-percentage, 'rest')")
    args = parser.parse_args(argv)
    try:
        specs = [SideSpec.parse(s) for s in args.side]
    except ValueError as e:  # before torch loads: a wrong side answers at once
        _reply(error=str(e))
        return 1
    import torch

    # deferred: torch (which it imports) loads only once the arguments are checked
    from bullet.partition.launch_stream import open_worker_partition

    if not args.cores:
        args.cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    sides: list[Side] = []
    try:
        granted, total = 0, args.total_units or None
        for spec in specs:
            if spec.units == "rest":
                total = total or (sides[0].backend.total_units if sides else None)
                if total is None:
                    raise ValueError("a first side cannot take 'rest' without --total-units")
                units = total - granted
            else:
                units = int(spec.units)
            if units < 1:
                raise ValueError(f"side {spec.name}: nothing left ({units} units)")
            backend, stream = open_worker_partition(spec.backend, spec.role, device,
                                                    _options(spec.backend, args, units))
            backend.apply(units)
            sides.append(Side(spec, backend, stream))
            granted += backend.current_units
        kernels, unavailable = None, {}
        if device.type == "cuda":
            try:
                kernels = load_for_current_device()
            except (RuntimeError, OSError) as e:  # no nvcc, a launch error: the GEMM can still run
                unavailable.update({k: f"probe kernels: {type(e).__name__}: {e}" for k in ("spin", "fma", "copy")})
        for kind in args.kinds.split(","):
            if kind in unavailable:
                continue
            for side in sides:
                try:
                    side.loops[kind] = _make_loop(kind, side, torch, device, kernels)
                except (ValueError, RuntimeError, OSError) as e:
                    unavailable[kind] = f"{type(e).__name__}: {e}"
            if kind in unavailable:
                for side in sides:
                    side.loops.pop(kind, None)
    except (PartitionUnavailable, RuntimeError, OSError, ValueError) as e:
        _reply(error=f"{type(e).__name__}: {e}")
        for side in sides:
            side.close()
        return 1
    _reply(ready=True, pid=os.getpid(), kinds=sorted({k for s in sides for k in s.loops}), unavailable=unavailable,
           sides={s.spec.name: {"backend": s.spec.backend, "role": s.spec.role, "units": s.backend.current_units,
                                "total": s.backend.total_units, "unit_set": s.backend.describe()["unit_set"]}
                  for s in sides})
    by_name = {s.spec.name: s for s in sides}
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "quit":
                break
            try:
                if cmd[0] == "run" and len(cmd) == 4:
                    chosen = [by_name[n] for n in cmd[3].split(",")]
                    missing = [s.spec.name for s in chosen if cmd[1] not in s.loops]
                    if missing:
                        raise ValueError(f"{cmd[1]} is not available ({unavailable.get(cmd[1], 'not asked for')})")
                    _reply(sides=_run_together(chosen, cmd[1], float(cmd[2])))
                elif cmd[0] == "graph" and len(cmd) == 3:
                    side = by_name[cmd[2]]
                    if "spin" not in side.loops:
                        raise ValueError(f"spin is not available ({unavailable.get('spin', 'not asked for')})")
                    if "graph" not in side.loops:
                        side.loops["graph"] = _make_loop("spin", side, torch, device, kernels, graph=True)
                    _reply(sides={side.spec.name: side.loops["graph"].run(float(cmd[1]))})
                else:
                    raise ValueError(f"unknown command {line.strip()!r}")
            except (KeyError, ValueError, RuntimeError, OSError) as e:
                _reply(error=f"{type(e).__name__}: {e}")
    finally:
        for side in sides:
            side.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
