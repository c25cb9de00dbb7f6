"""One side of the cross-process isolation check: a process that holds a share of the device the way
a worker does (the same partition backend, opened by `open_worker_partition`) and loops a GEMM on
it when told to, reporting its rate.

Commands on stdin, one JSON answer a line on stdout:

    (at start)   -> {"ready": true, "units": granted share, "total": units of the device, ...}
    run SECONDS  -> loop the GEMM for SECONDS; {"iterations": n, "seconds": t, "rate": n / t}
    share ROLE N -> give up the share and take N units as ROLE (the next pair of shares without a new
                    process); answered like the start
    quit         -> exit

Between commands the process launches nothing, so the other side can be timed alone. A start-up
failure answers {"error": "..."} instead of ready.
Usage: python -m bullet.doctor.isolation_child --backend green-ctx --role prefill --units 64 --device cuda"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bullet.partition import BACKENDS, PartitionUnavailable, parse_id_list
from bullet.partition.launch_stream import open_worker_partition

CHUNK_S = 0.01  # GEMMs launched between two synchronisations: about this long


def _reply(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _options(args) -> dict:
    if args.backend == "cpu":
        return {"cores": sorted(parse_id_list(args.cores))} if args.cores else {}
    if args.backend == "green-ctx":
        return {"counts": [args.units]}  # one pool entry (and the whole device): little memory
    if args.backend == "libsmctrl":
        return {"library": args.library, "allow_untested_driver": args.allow_untested_driver}
    if args.backend == "mps-percentage" and args.total_units:
        return {"total_units": args.total_units}
    return {}


class GemmLoop:
    """Square matrix products on the worker's share: on its partitioned stream on a GPU, on its
    pinned threads on a CPU."""

    def __init__(self, torch, device, stream, size: int):
        self.torch, self.stream = torch, stream
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        with stream.step():
            self.a = torch.randn(size, size, device=device, dtype=dtype)
            self.b = torch.randn(size, size, device=device, dtype=dtype)
            self.c = torch.empty(size, size, device=device, dtype=dtype)
            self.chunk = 1
            self._burst(3)  # warm-up: library handles and workspaces, never inside a timed round
            t0 = time.perf_counter()
            self._burst(3)
            each = (time.perf_counter() - t0) / 3
        self.chunk = max(1, int(CHUNK_S / each)) if each > 0 else 1

    def _burst(self, n: int) -> None:
        for _ in range(n):
            self.torch.matmul(self.a, self.b, out=self.c)
        self.stream.synchronize()

    def run(self, seconds: float) -> dict:
        n = 0
        with self.stream.step():
            t0 = time.perf_counter()
            while True:
                self._burst(self.chunk)
                n += self.chunk
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    break
        return {"iterations": n, "seconds": elapsed, "rate": n / elapsed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--units", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--cores", help="cpu backend: the cores it divides (default: the affinity at start)")
    parser.add_argument("--library", help="libsmctrl.so (default: $BULLET_LIBSMCTRL)")
    parser.add_argument("--allow-untested-driver", action="store_true")
    parser.add_argument("--total-units", type=int, default=0,
                        help="mps-percentage: the device's SMs as an uncapped process counts them (under the cap, "
                             "torch reports the capped count)")
    parser.add_argument("--size", type=int, default=0, help="matrix size (default: 4096 on a GPU, 192 on a CPU)")
    args = parser.parse_args(argv)

    if args.backend not in BACKENDS:  # before torch loads: a wrong name answers at once
        _reply(error=f"unknown partition backend {args.backend!r}; choose from {', '.join(BACKENDS)}")
        return 1
    import torch

    if args.backend == "cpu" and not args.cores:
        # the cores at start, kept: a share taken again (`share`) divides the same set, not the one
        # core the last share pinned this process to
        args.cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    size = args.size or (4096 if args.device == "cuda" else 192)
    held = _take_share(torch, device, args, size)
    if held is None:
        return 1
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "quit":
                break
            if cmd[0] == "run":
                _reply(**held[1].run(float(cmd[1])))
            elif cmd[0] == "share" and len(cmd) == 3:
                backend = held[0]
                held = None  # the GEMM loop's tensors go before the stream they ran on
                backend.close()
                args.role, args.units = cmd[1], int(cmd[2])
                held = _take_share(torch, device, args, size)
                if held is None:
                    return 1
            else:
                _reply(error=f"unknown command {line.strip()!r}")
    finally:
        if held is not None:
            backend = held[0]
            held = None  # as above
            backend.close()
    return 0


def _take_share(torch, device, args, size: int):
    """(backend, GEMM loop) on `args.units` units as `args.role`, announced on stdout; None (and an
    error answer) when the backend cannot give it."""
    try:
        backend, stream = open_worker_partition(args.backend, args.role, device, _options(args))
        backend.apply(args.units)
        loop = GemmLoop(torch, device, stream, size)
    except (PartitionUnavailable, RuntimeError, OSError, ValueError) as e:
        _reply(error=f"{type(e).__name__}: {e}")
        return None
    _reply(ready=True, pid=os.getpid(), backend=args.backend, role=args.role, units=backend.current_units,
           total=backend.total_units, size=size, chunk=loop.chunk)
    return backend, loop


if __name__ == "__main__":
    sys.exit(main())
