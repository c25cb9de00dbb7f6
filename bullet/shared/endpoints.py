"""ZMQ endpoints of one server instance: Unix-domain sockets inside a runtime directory that only
the server's user can enter (mode 0700, made by `mkdtemp`), so no other local user can connect to a
worker or the frontend — unlike abstract-namespace sockets, which have no permissions at all.

The incarnation number changes when the workers are restarted, so a message addressed to a dead
worker never reaches its replacement; the frontend's socket outlives restarts."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

PREFIX = "bullet-"


@dataclass(frozen=True)
class Endpoints:
    prefill_in: str  # frontend -> prefill: requests, aborts
    decode_in: str  # prefill -> decode: handoffs; frontend -> decode: aborts
    frontend_in: str  # prefill, decode -> frontend: outputs

    @classmethod
    def in_dir(cls, runtime_dir: str | Path, incarnation: int) -> "Endpoints":
        base = Path(runtime_dir)
        # late outputs of a dead incarnation name requests the frontend has already failed and are dropped there
        return cls(f"ipc://{base}/prefill-{incarnation}.sock", f"ipc://{base}/decode-{incarnation}.sock",
                   f"ipc://{base}/frontend.sock")


def make_runtime_dir(instance_id: str) -> Path:
    """A fresh private directory for an instance's sockets (0700; short, so socket paths stay within
    the 107 bytes a Unix socket address allows)."""
    root = os.environ.get("XDG_RUNTIME_DIR")
    if not root or not os.access(root, os.W_OK) or len(root) > 40:
        root = None
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{instance_id}-", dir=root))
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode != 0o700:  # mkdtemp promises this; refuse to serve from a directory others can enter
        shutil.rmtree(path, ignore_errors=True)
        raise PermissionError(f"{path} has mode {mode:o}, not 700")
    return path


def remove_runtime_dir(path: str | Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def stale_runtime_dirs(instance_alive) -> list[Path]:
    """Runtime directories of this user's instances whose creator is gone (`instance_alive(id)`
    answers False), in the places `make_runtime_dir` uses."""
    roots = {Path(tempfile.gettempdir())}
    if os.environ.get("XDG_RUNTIME_DIR"):
        roots.add(Path(os.environ["XDG_RUNTIME_DIR"]))
    found = []
    for root in roots:
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for entry in entries:
            name = entry.name
            if not name.startswith(PREFIX) or not entry.is_dir() or entry.is_symlink():
                continue
            instance_id = name[len(PREFIX):].rsplit("-", 1)[0]
            try:
                mine = entry.stat().st_uid == os.getuid()
            except OSError:
                continue
            if mine and instance_alive(instance_id) is False:
                found.append(entry)
    return found
