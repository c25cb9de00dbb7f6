"""Segment naming and lifecycle: no /dev/shm leftovers after normal exit, SIGINT, SIGTERM (with a
chained handler), and — through cleanup_instance — after SIGKILL. Real child processes (spawn)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import posix_ipc
import pytest

from bullet.shm import segments as shm
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.shm.state_buffer import StateBuffer, WorkerState

SPAWN = mp.get_context("spawn")


@pytest.fixture
def tracked():
    """Instance ids a test (or its children) created; after the test, asserts none of them — nor
    any instance created by this process — left anything in /dev/shm, and removes it either way."""
    before = {i.instance_id for i in shm.list_instances()}
    ids: list[str] = []
    yield ids
    mine = {i.instance_id for i in shm.list_instances() if i.creator_pid == os.getpid()} - before
    leaked = {i: shm.segments_of(i) for i in mine | set(ids) if shm.segments_of(i)}
    for i in leaked:
        shm.cleanup_instance(i)
    assert not leaked, f"test leaked shared memory: {leaked}"


def _create_instance(iid: str) -> tuple[StateBuffer, SharedPageAllocator]:
    sb = StateBuffer.create(iid)
    sb.publish("prefill", WorkerState(pid=os.getpid()))
    return sb, SharedPageAllocator.create(iid, 32, 16)


def _serve(conn, own_handler_marker: str | None = None) -> None:
    """Child: (optionally install its own SIGTERM handler first), create an instance, report its id,
    then idle in Python code so that signal handlers run. Ctrl-C gets Python's default handler first:
    a child inherits an ignored SIGINT (pytest run as a background job of a script ignores it), and
    what is tested is that the segments go and the handler found is still called."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if own_handler_marker:
        def graceful(signum, frame):
            Path(own_handler_marker).write_text("handled")
            sys.exit(3)

        signal.signal(signal.SIGTERM, graceful)
    iid = shm.new_instance_id()
    _create_instance(iid)
    conn.send(iid)
    while True:
        time.sleep(0.01)


def _create_and_return(conn) -> None:
    iid = shm.new_instance_id()
    _create_instance(iid)
    conn.send((iid, shm.segments_of(iid)))


def _start_server(tracked, **kwargs) -> tuple[mp.Process, str]:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_serve, args=(child,), kwargs=kwargs)
    proc.start()
    assert parent.poll(60), "child did not report its instance"
    iid = parent.recv()
    tracked.append(iid)
    assert shm.segments_of(iid) == [f"bullet-{iid}-pages", f"bullet-{iid}-state"]
    return proc, iid


def _join(proc: mp.Process) -> int | None:
    """The child's exit code; a child still running after a minute is killed (and None returned), so
    that a failed test does not leave pytest waiting for it at exit."""
    proc.join(60)
    if proc.exitcode is None:
        proc.kill()
        proc.join(10)
        return None
    return proc.exitcode


def test_names_and_ids():
    iid = shm.new_instance_id()
    assert shm.creator_pid(iid) == os.getpid() and iid != shm.new_instance_id()
    assert shm.segment_name(iid, "state") == f"/bullet-{iid}-state"
    assert shm.creator_pid("my_server") is None
    for bad in ("a-b", "", "x/y", "a" * 65):
        with pytest.raises(ValueError):
            shm.segment_name(bad, "state")
    with pytest.raises(ValueError):
        shm.segment_name(iid, "kv-pool")


def test_close_and_unlink_leave_nothing(tracked):
    iid = shm.new_instance_id()
    sb, pages = _create_instance(iid)
    assert set(shm.owned_segments()) >= {sb.name, pages.name}
    with pytest.raises(FileExistsError):
        StateBuffer.create(iid)  # an instance id is never silently shared
    sb.close(), pages.close()
    sb.close(), pages.close()  # closing twice is harmless
    sb.unlink(), pages.unlink()
    assert shm.segments_of(iid) == [] and not set(shm.owned_segments()) & {sb.name, pages.name}


def test_exit_hook_unlinks_what_this_process_created(tracked):
    iid = shm.new_instance_id()
    sb, pages = _create_instance(iid)
    sb.close(), pages.close()
    assert set(shm.unlink_owned()) >= {f"/bullet-{iid}-state", f"/bullet-{iid}-pages"}
    assert shm.segments_of(iid) == []


def test_normal_child_exit_runs_atexit_cleanup(tracked):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_create_and_return, args=(child,))
    proc.start()
    iid, seen = parent.recv()
    tracked.append(iid)
    proc.join(60)
    assert proc.exitcode == 0 and len(seen) == 2
    assert shm.segments_of(iid) == []


def test_sigterm_leaves_no_segment(tracked):
    proc, iid = _start_server(tracked)
    proc.terminate()
    assert _join(proc) == -signal.SIGTERM  # the default action still happens after cleanup
    assert shm.segments_of(iid) == []


def test_sigint_leaves_no_segment(tracked):
    proc, iid = _start_server(tracked)
    os.kill(proc.pid, signal.SIGINT)
    assert _join(proc) == 1  # KeyboardInterrupt from the chained default handler
    assert shm.segments_of(iid) == []


def test_sigterm_chains_to_a_previously_installed_handler(tracked, tmp_path):
    marker = tmp_path / "handled"
    proc, iid = _start_server(tracked, own_handler_marker=str(marker))
    proc.terminate()
    assert _join(proc) == 3 and marker.read_text() == "handled"
    assert shm.segments_of(iid) == []


def test_sigkill_then_cleanup_instance_removes_everything(tracked):
    proc, iid = _start_server(tracked)
    sb = StateBuffer.attach(iid)  # a survivor still mapping the segment (like the other worker)
    proc.kill()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert len(shm.segments_of(iid)) == 2  # a killed process cannot clean up after itself
    stale = {i.instance_id: i for i in shm.stale_instances()}
    assert iid in stale and stale[iid].creator_pid == proc.pid and not stale[iid].creator_alive
    assert sorted(shm.cleanup_instance(iid)) == [f"bullet-{iid}-pages", f"bullet-{iid}-state"]
    assert shm.segments_of(iid) == [] and iid not in {i.instance_id for i in shm.list_instances()}
    assert sb.read("prefill").pid == proc.pid  # existing mappings stay valid after unlink
    sb.close()
    assert shm.cleanup_instance(iid) == []  # idempotent


def test_live_instances_are_not_stale(tracked):
    iid = shm.new_instance_id()
    sb = StateBuffer.create(iid)
    try:
        info = next(i for i in shm.list_instances() if i.instance_id == iid)
        assert info.creator_alive and iid not in {i.instance_id for i in shm.stale_instances()}
    finally:
        sb.close()
        sb.unlink()


def test_cleanup_instance_also_removes_semaphores_and_spares_other_instances(tracked):
    a, b = shm.new_instance_id(), shm.new_instance_id()
    sem = posix_ipc.Semaphore(shm.segment_name(a, "wakeup"), posix_ipc.O_CREX, initial_value=0)
    shm.register_semaphore(sem.name)
    sbs = [StateBuffer.create(a), StateBuffer.create(b)]
    for sb in sbs:
        sb.close()
    assert shm.segments_of(a) == [f"bullet-{a}-state", f"sem.bullet-{a}-wakeup"]
    assert sorted(shm.cleanup_instance(a)) == [f"bullet-{a}-state", f"sem.bullet-{a}-wakeup"]
    sem.close()
    assert shm.segments_of(a) == [] and shm.segments_of(b) == [f"bullet-{b}-state"]
    assert sem.name not in shm.owned_segments()
    sbs[1].unlink()


def test_forked_child_does_not_unlink_parent_segments(tracked):
    iid = shm.new_instance_id()
    sb = StateBuffer.create(iid)
    try:
        pid = os.fork()
        if pid == 0:  # child: run the exit-time cleanup it inherited, then leave without pytest's teardown
            code = 2
            try:
                code = 1 if shm.unlink_owned() else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert shm.segments_of(iid) == [f"bullet-{iid}-state"]
    finally:
        sb.close()
        sb.unlink()


def _blocked_on_allocator(allocator_iid: str, conn) -> None:
    """Child: own an instance, then block on an allocator lock another process holds."""
    iid = shm.new_instance_id()
    StateBuffer.create(iid)
    alloc = SharedPageAllocator.attach(allocator_iid)
    conn.send(iid)
    alloc.alloc(1, owner=1)


def test_sigterm_reaches_a_process_blocked_on_the_allocator_lock(tracked):
    iid = shm.new_instance_id()
    alloc = SharedPageAllocator.create(iid, 8, 16)
    alloc._mutex.acquire()
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_blocked_on_allocator, args=(iid, child))
    try:
        proc.start()
        child_iid = parent.recv()
        tracked.append(child_iid)
        time.sleep(0.2)  # let it block in alloc()
        assert proc.is_alive() and shm.segments_of(child_iid)
        proc.terminate()
        proc.join(10)
        assert proc.exitcode == -signal.SIGTERM and shm.segments_of(child_iid) == []
    finally:
        alloc._mutex.release()
        if proc.is_alive():
            proc.kill()
            proc.join()
        alloc.close()
        alloc.unlink()
