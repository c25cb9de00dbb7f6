"""Process entry point of a worker: wire the shared model, shared memory, sockets, partition backend
and policy together, run the role's loop, and clean up however it ends.

Signals: SIGINT is ignored (Ctrl-C reaches the whole process group; the launcher coordinates the
shutdown), SIGTERM asks the loop to stop after its current step, and the kernel sends SIGTERM when
the launcher dies (PR_SET_PDEATHSIG) — then the last worker out removes the instance's segments."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass, field

from bullet.config import ServerArgs
from bullet.runtime.endpoints import Endpoints
from bullet.runtime.shared_model import SharedModel

log = logging.getLogger("bullet.worker")
PR_SET_PDEATHSIG = 1


@dataclass
class WorkerSpec:
    role: str  # "prefill" | "decode" | "unified" (the chunked baseline's single worker)
    instance_id: str
    incarnation: int
    args: ServerArgs
    model: SharedModel
    endpoints: Endpoints
    cores: list[int]
    launcher_pid: int
    initial_units: int = 1
    extra: dict = field(default_factory=dict)


class StopFlag:
    def __init__(self):
        self.stop = False

    def __call__(self, signum, frame):
        self.stop = True


def _die_with_parent(launcher_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the loop's parent-pid check still ends the worker
    if os.getppid() != launcher_pid:  # the launcher died before we got here
        sys.exit(1)


def worker_main(spec: WorkerSpec) -> None:
    logging.basicConfig(level=spec.args.log_level.upper(),
                        format=f"[%(asctime)s {spec.role}] %(levelname)s %(message)s")
    stop = StopFlag()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    _die_with_parent(spec.launcher_pid)
    from engines.workers.context import build_context

    ctx = None
    code = 0
    try:
        ctx = build_context(spec, stop)
        if spec.role == "prefill":
            from engines.workers.prefill_loop import PrefillLoop

            PrefillLoop(ctx).run()
        elif spec.role == "unified":
            from engines.workers.unified_loop import UnifiedLoop

            UnifiedLoop(ctx).run()
        else:
            from engines.workers.decode_loop import DecodeLoop

            DecodeLoop(ctx).run()
    except Exception:
        log.error("worker failed:\n%s", traceback.format_exc())
        code = 1
        if ctx is not None:
            ctx.mark_failed()
    finally:
        if ctx is not None:
            ctx.close()
        if os.getppid() != spec.launcher_pid:  # orphaned: nobody else will remove the segments
            from bullet.shm import cleanup_instance

            cleanup_instance(spec.instance_id)
    sys.exit(code)
