"""Process entry point of a worker: wire the shared model, shared memory, sockets, partition backend
and loop core together, run the loop, and clean up however it ends.

Signals: SIGINT is ignored (Ctrl-C reaches the whole process group; the launcher coordinates the
shutdown), SIGTERM asks the loop to stop after its current step, and the kernel sends SIGTERM when
the launcher dies (PR_SET_PDEATHSIG). An orphaned worker — its launcher is gone, whether it notices
at startup or later — removes the instance's segments and socket directory on its way out."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback

import setproctitle

from bullet.shared.endpoints import remove_runtime_dir
from bullet.shm.segments import cleanup_instance, unlink_owned
from bullet.workers.spec import WorkerSpec
from bullet.workers.tensor_parallel import follow_main
from bullet.workers.wiring import Worker, build_worker

log = logging.getLogger("bullet.worker")
PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 5.0  # how long a worker stopped by a signal waits to learn whether its launcher is dying


class StopFlag:
    def __init__(self):
        self.stop = False

    def __call__(self, signum=None, frame=None) -> bool:
        if signum is not None:
            self.stop = True
        return self.stop


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the loop's parent-pid check still ends the worker


def _orphaned(spec: WorkerSpec, launcher_asked: bool, signalled: bool) -> bool:
    """Whether the launcher is gone. The death signal comes when the launcher's *thread* that started
    us exits, and the kernel may first re-parent us to another of its dying threads — so right after a
    SIGTERM nobody asked for, getppid() can still name the launcher for a moment. Wait for it to settle."""
    if os.getppid() != spec.launcher_pid:
        return True
    if launcher_asked or not signalled:
        return False
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if os.getppid() != spec.launcher_pid:
            return True
    return False


def worker_main(spec: WorkerSpec) -> None:
    setproctitle.setproctitle(spec.title)
    logging.basicConfig(level=spec.args.log_level.upper(),
                        format=f"[%(asctime)s {spec.role.value}] %(levelname)s %(message)s")
    stop = StopFlag()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    _die_with_parent()
    if spec.tp_rank:
        _exit(_follower(spec))
    worker: Worker | None = None
    code = 0
    try:
        if os.getppid() == spec.launcher_pid:  # else the launcher died before the death signal was armed
            worker = build_worker(spec, lambda: stop.stop)
            worker.io.wake_on_signals()  # a SIGTERM ends an idle worker's wait on its socket at once
            worker.run()
        else:
            code = 1
    except Exception:
        log.error("worker failed:\n%s", traceback.format_exc())
        code = 1
        if worker is not None:
            worker.mark_failed()
    finally:
        asked = worker is not None and worker.shutdown_requested()
        if _orphaned(spec, asked, stop.stop):  # nobody else will remove the instance's files: first thing
            cleanup_instance(spec.instance_id)
            remove_runtime_dir(spec.runtime_dir)
        if worker is not None:
            worker.close()
    _exit(code)


def _follower(spec: WorkerSpec) -> int:
    """Rank 1.. of a tensor-parallel worker: it follows rank 0 (nothing of the instance is its to clean)."""
    try:
        return follow_main(spec) if os.getppid() == spec.launcher_pid else 1
    except Exception:
        log.error("rank %d of the %s worker failed:\n%s", spec.tp_rank, spec.role.value, traceback.format_exc())
        return 1


def _exit(code: int) -> None:
    """Every worker process skips the interpreter's finalization (os._exit) once its own clean-up ran
    (`worker.close()`, the segments it created, the logs flushed): tearing down torch's modules and
    threads took ~0.6 s of each stop and restart, and for a tensor-parallel rank it can abort
    tearing down gloo's threads ("terminate called without an active exception"), which would turn
    a clean stop into a crash report."""
    unlink_owned()  # what atexit would have done for segments this process created
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
