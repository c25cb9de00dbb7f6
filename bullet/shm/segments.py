"""Naming and lifecycle of a server instance's POSIX shared-memory segments.

Every segment of one server is named `/bullet-<instance_id>-<what>` (it appears as
`/dev/shm/bullet-<instance_id>-<what>`; POSIX semaphores as `/dev/shm/sem.bullet-<instance_id>-<what>`).
`new_instance_id()` is `<creator pid>x<32 random bits>`, so two servers on one host never collide and
a crashed server's leftovers can be recognised: its creator pid no longer runs.

Segments outlive processes, so each one has exactly one owner — the process that created it —
which unlinks it on normal exit (atexit) and on SIGINT/SIGTERM (handlers that chain to whatever was
installed before). A SIGKILLed owner cannot clean up: the launcher calls `cleanup_instance()` when a
worker dies or at shutdown, and `stale_instances()` finds what a crashed launcher left behind.
Attaching processes never unlink anything on exit, and a forked child does not inherit the duty.

The SIGINT/SIGTERM handlers are installed when the process creates its first segment. A handler
installed after that replaces ours: it should call the handler it replaced, or end the process with
SystemExit/KeyboardInterrupt (so that atexit runs). Unlinking on a signal does not disturb processes
that already map a segment; it only stops new ones from attaching."""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import posix_ipc

SHM_DIR = Path("/dev/shm")
PREFIX = "bullet"
_ID_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")  # no '-': it separates the id from the segment's role
_WHAT_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
_CREATOR_RE = re.compile(r"^(\d+)x[0-9a-f]+$")


def new_instance_id() -> str:
    return f"{os.getpid()}x{secrets.token_hex(4)}"


def _check_id(instance_id: str) -> str:
    if not _ID_RE.match(instance_id):
        raise ValueError(f"instance id {instance_id!r} must be 1-64 characters of [A-Za-z0-9_.] (no '-')")
    return instance_id


def segment_name(instance_id: str, what: str) -> str:
    if not _WHAT_RE.match(what):
        raise ValueError(f"segment role {what!r} must be 1-64 characters of [A-Za-z0-9_.]")
    return f"/{PREFIX}-{_check_id(instance_id)}-{what}"


def creator_pid(instance_id: str) -> int | None:
    """The pid encoded by `new_instance_id()`, or None for an id chosen another way."""
    m = _CREATOR_RE.match(instance_id)
    return int(m.group(1)) if m else None


# ---- the owner's registry ---------------------------------------------------------------------

class _Registry:
    """Names this process created and must unlink. Entries remember the registering pid: after a
    fork the child sees the parent's entries but must not unlink the parent's live segments."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: the signal handler may interrupt add()/discard()
        self._owned: dict[str, tuple[int, str]] = {}  # name -> (owner pid, "shm" | "sem")
        self._hooks_installed = False
        self._previous: dict[int, object] = {}

    def add(self, name: str, kind: str = "shm") -> None:
        with self._lock:
            self._owned[name] = (os.getpid(), kind)
        self._install_hooks()

    def discard(self, name: str) -> None:
        with self._lock:
            self._owned.pop(name, None)

    def owned(self) -> list[str]:
        pid = os.getpid()
        with self._lock:
            return [n for n, (owner, _) in self._owned.items() if owner == pid]

    def unlink_all(self) -> list[str]:
        pid = os.getpid()
        with self._lock:
            mine = [(n, kind) for n, (owner, kind) in self._owned.items() if owner == pid]
            for n, _ in mine:
                del self._owned[n]
        for name, kind in mine:
            _unlink(name, kind)
        return [n for n, _ in mine]

    def _install_hooks(self, signals: bool = True) -> None:
        if self._hooks_installed:
            return
        self._hooks_installed = True
        atexit.register(self.unlink_all)
        if not signals:
            return
        # signal.signal only works in the main thread; elsewhere atexit still covers normal exit.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.unlink_all()
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # e.g. Python's default SIGINT handler raises KeyboardInterrupt
        elif previous != signal.SIG_IGN:
            # SIG_DFL, or None (a handler installed outside Python, which cannot be called from here):
            # die of the same signal, so the parent sees the usual exit status (-SIGTERM).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


_registry = _Registry()


def cleanup_at_exit_only() -> None:
    """For a process that handles SIGINT/SIGTERM itself and cleans up on its way out (the launcher
    drains first): unlink owned segments at exit, but install no signal handlers of ours. Call it
    before creating the first segment."""
    _registry._install_hooks(signals=False)


def owned_segments() -> list[str]:
    """Names this process created and will unlink at exit."""
    return _registry.owned()


def unlink_owned() -> list[str]:
    """Unlink everything this process created (what atexit and the signal handlers run)."""
    return _registry.unlink_all()


def register_semaphore(name: str) -> None:
    """Hand a POSIX semaphore this process created (named with `segment_name`) to the registry."""
    _registry.add(name, "sem")


def _unlink(name: str, kind: str = "shm") -> bool:
    try:
        (posix_ipc.unlink_shared_memory if kind == "shm" else posix_ipc.unlink_semaphore)(name)
        return True
    except posix_ipc.ExistentialError:
        return False


# ---- segments ---------------------------------------------------------------------------------

@dataclass
class Segment:
    """One mapped segment. `close()` unmaps it (every process); `unlink()` removes the name (the owner;
    mappings stay valid until closed)."""

    name: str
    mm: mmap.mmap
    owner: bool
    _closed: bool = field(default=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.mm)

    def close(self) -> None:
        if not self._closed:
            self.mm.close()  # raises BufferError while a view (numpy array, SharedRegion) still exists
            self._closed = True

    def unlink(self) -> None:
        _unlink(self.name)
        _registry.discard(self.name)


def create_segment(instance_id: str, what: str, size: int) -> Segment:
    """Create (exclusively) and map a zero-filled segment; this process becomes its owner."""
    name = segment_name(instance_id, what)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except posix_ipc.ExistentialError:
        raise FileExistsError(f"shared-memory segment {name} already exists (instance id reused?)") from None
    _registry.add(name)  # registered before mapping so a failure below still gets it unlinked
    try:
        mm = mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()
    return Segment(name, mm, owner=True)


def attach_segment(instance_id: str, what: str) -> Segment:
    name = segment_name(instance_id, what)
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise FileNotFoundError(f"shared-memory segment {name} does not exist (server not running?)") from None
    try:
        mm = mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()
    return Segment(name, mm, owner=False)


# ---- discovery and cleanup --------------------------------------------------------------------

def segments_of(instance_id: str) -> list[str]:
    """Names (as in /dev/shm) of every shared-memory segment and semaphore of one instance."""
    _check_id(instance_id)
    pattern = f"{PREFIX}-{instance_id}-"
    return sorted(p.name for p in SHM_DIR.iterdir()
                  if p.name.startswith(pattern) or p.name.startswith("sem." + pattern))


def cleanup_instance(instance_id: str) -> list[str]:
    """Unlink every segment and semaphore of an instance, whoever created them; returns their names.
    Safe to call repeatedly and while other processes still map them (their mappings stay valid)."""
    removed = []
    for entry in segments_of(instance_id):
        kind, name = ("sem", "/" + entry[4:]) if entry.startswith("sem.") else ("shm", "/" + entry)
        if _unlink(name, kind):
            removed.append(entry)
        _registry.discard(name)
    return removed


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    creator_pid: int | None
    segments: tuple[str, ...]

    @property
    def creator_alive(self) -> bool | None:
        return None if self.creator_pid is None else _pid_alive(self.creator_pid)


def _pid_alive(pid: int) -> bool:
    # A zombie (exited, not yet reaped) counts as alive; a reused pid makes a dead server look alive,
    # which errs on the side of keeping segments.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_instances() -> list[InstanceInfo]:
    found: dict[str, list[str]] = {}
    for p in SHM_DIR.iterdir():
        name = p.name[4:] if p.name.startswith("sem.") else p.name
        parts = name.split("-", 2)
        if len(parts) == 3 and parts[0] == PREFIX and _ID_RE.match(parts[1]):
            found.setdefault(parts[1], []).append(p.name)
    return [InstanceInfo(i, creator_pid(i), tuple(sorted(s))) for i, s in sorted(found.items())]


def instance_alive(instance_id: str) -> bool | None:
    """Whether the instance's creator still runs (None: the id does not say who created it)."""
    pid = creator_pid(instance_id)
    return None if pid is None else _pid_alive(pid)


def stale_instances() -> list[InstanceInfo]:
    """Instances whose creator pid is known and no longer running."""
    return [info for info in list_instances() if info.creator_alive is False]


def shm_free_bytes() -> int | None:
    """Bytes free for new shared memory in SHM_DIR (torch's CPU tensors are shared there too), or None
    where there is no such directory to ask."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
