"""A stand-in worker process for checking the `cpu` backend from outside.

It builds the backend like a worker would, keeps a torch matmul loop running, and between two
iterations (where a worker applies its share) executes commands read from stdin, answering each with
one JSON line on stdout:

    apply N   -> backend.apply(N); reply with the granted share, torch's thread count and tids
    spawn     -> start one more (idle) thread, to show threads created after apply are covered
    quit      -> exit

The parent verifies the reply against /proc/<pid>/task/*/status, which the child cannot fake.
Usage: python -m bullet.doctor.cpu_probe_child --role decode [--cores 0,1] [--size 128]"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import threading

from bullet.partition import make_backend, parse_id_list


def _reply(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _idle_thread(stop: threading.Event) -> threading.Thread:
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--cores", help="cpu ids the backend may use (default: the affinity at start)")
    parser.add_argument("--size", type=int, default=128, help="matmul size; 0 disables the loop")
    args = parser.parse_args(argv)

    import torch

    opts = {"cores": sorted(parse_id_list(args.cores))} if args.cores else {}
    backend = make_backend("cpu", args.role, **opts)
    stop = threading.Event()
    _idle_thread(stop)  # a thread torch knows nothing about: apply must pin it too
    a = torch.randn(args.size, args.size) if args.size else None
    if a is not None:
        (a @ a).sum()  # start torch's intra-op pool before the first apply, as in a real worker
    _reply(ready=True, pid=os.getpid(), total_units=backend.total_units,
           tids=sorted(int(t) for t in os.listdir("/proc/self/task")))

    pending = b""
    iterations = 0
    while True:
        readable, _, _ = select.select([0], [], [], 0 if a is not None else None)
        if readable:
            chunk = os.read(0, 4096)
            if not chunk:
                break
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd = line.decode().split()
            if not cmd:
                continue
            if cmd[0] == "quit":
                stop.set()
                return 0
            if cmd[0] == "apply":
                backend.apply(int(cmd[1]))
            elif cmd[0] == "spawn":
                _idle_thread(stop)
            _reply(command=cmd[0], current_units=backend.current_units,
                   unit_set=sorted(backend.unit_set()), torch_threads=torch.get_num_threads(),
                   tids=sorted(int(t) for t in os.listdir("/proc/self/task")),
                   iterations=iterations, apply_cost=backend.apply_costs().as_dict())
        if a is not None:
            (a @ a).sum()
            iterations += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
