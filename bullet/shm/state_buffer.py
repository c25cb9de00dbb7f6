"""The state buffer: where the prefill and decode workers publish their state and read each other's
(Bullet §3.4.1, "global metadata buffer"). One POSIX shared-memory segment per server instance,
`/bullet-<instance_id>-state`, one 4 KiB page.

Layout, version 6 (all little-endian; offsets in bytes):

    header, offset 0, 128 bytes
      0   8  magic            b"BULLETSB"; stored last, with release order, by the creator, so an
                              attacher that sees it also sees the rest of the header
      8   4  layout_version   u32 = 6; bumped on any change to this table (2: pause_budget_ms;
                              3: decisions, repartitions; 4: unit_mask_ext; 5: claimed_units;
                              6: handoffs_seen)
     12   4  header_size      u32 = 128
     16   4  block_stride     u32 = 256 (one block per worker, 256-byte aligned: no false sharing)
     20   4  num_blocks       u32 = 2
     24   8  created_ns       u64 wall clock (time.time_ns) at creation
     32   8  creator_pid      u64
     40   8  control          u64 atomic flag word (ControlFlags: SHUTDOWN), set by the launcher
     48  64  instance_id      ASCII, NUL-padded
    112  16  reserved

    block of role r (0 = prefill, 1 = decode), offset 128 + 256 * r
      0   8  seq              seqlock sequence: odd while the worker writes, even when stable. Exactly
                              one writer per block (its worker); readers retry until they copy
                              the payload between two equal even values, so a read is never torn.
      8      payload          WorkerState, packed as struct "<" + PAYLOAD_FORMAT:
      8   8  heartbeat_ns     u64  time.monotonic_ns() at publish (stamped by publish())
     16   8  heartbeat_count  u64  publishes by this role so far (stamped by publish())
     24   8  pid              u64  worker process id
     32   8  step             u64  steps completed (prefill: layer groups; decode: iterations)
     40   8  flags            u64  WorkerFlags bits: READY, PAUSED, STOPPED, FAILED
     48   4  batch_size       u32  requests in the running batch
     52   4  queued_requests  u32  requests waiting to be scheduled
     56   8  queued_tokens    u64  prompt tokens waiting
     64   8  tokens_in_flight u64  tokens processed by the current step
     72   4  remaining_layers u32  prefill layers left for the in-flight batch (decode: 0)
     76   4  compute_units    u32  current compute share, in units (SMs/TPCs; CPU cores)
     80   8  unit_mask_lo     u64  unit set, units 0-63 (bit u set = unit u in use)
     88   8  unit_mask_hi     u64  unit set, units 64-127
     96   8  ttft_pred_p90_ms f64  predicted P90 TTFT of queued + in-flight prefills
    104   8  ttft_obs_ms      f64  last observed TTFT
    112   8  tpot_pred_p90_ms f64  predicted P90 TPOT of the running decode batch
    120   8  tpot_obs_ms      f64  last observed TPOT
    128   8  step_pred_ms     f64  predicted latency of the next step
    136   8  step_obs_ms      f64  observed latency of the last step
    144   8  pause_budget_ms  f64  decode: how long it could pause now with every running request still
                              meeting its TPOT target (prefill: 0); what lets the prefill scheduler
                              take every unit during a burst (Bullet §3.3)
    152   8  decisions        u64  scheduling decisions taken so far
    160   8  repartitions     u64  changes of the worker's compute share so far
    168   8  unit_mask_ext    u64  unit set, units 128-191 (an H200 has 132 SMs)
    176   4  claimed_units    u32  prefill: the share it has chosen while it runs on less, beside the
                              units a decode step holds until that step ends (0: none); decode's
                              next step takes the complement of it
    180   8  handoffs_seen    u64  decode: requests handed over by prefill that it has received so
                              far; prefill counts those it sent beyond this as still in flight
    188      (end; the rest of the 256-byte block is free for later versions)

All latencies are in milliseconds; heartbeat_ns is CLOCK_MONOTONIC, which is system-wide on Linux
and so comparable between the two workers and the launcher."""

from __future__ import annotations

import operator
import os
import struct
import time
from dataclasses import fields

from bullet._shmatomic import SeqlockTimeout, SharedRegion
from bullet.shm.segments import Segment, attach_segment, create_segment
from bullet.types.roles import BLOCK_ROLES, Role
from bullet.types.worker_state import ControlFlags, WorkerFlags, WorkerState

MAGIC = b"BULLETSB"
LAYOUT_VERSION = 6
HEADER_SIZE = 128
BLOCK_STRIDE = 256
ROLES = tuple(r.value for r in BLOCK_ROLES)
SEGMENT_ROLE = "state"
SEGMENT_SIZE = 4096

_HEADER = struct.Struct("<8sIIIIQQQ64s")  # magic .. instance_id; control is written atomically
_CONTROL_OFFSET = 40
_HEARTBEAT_COUNT = struct.Struct("<Q")  # at block offset 16


class StateBufferLayoutError(RuntimeError):
    """The segment exists but is not a state buffer of the layout this code understands."""


_FIELD_FORMATS = {"u64": "Q", "u32": "I", "f64": "d"}
PAYLOAD_FORMAT = "QQQQQIIQQIIQQdddddddQQQIQ"
_PAYLOAD = struct.Struct("<" + PAYLOAD_FORMAT)
PAYLOAD_SIZE = _PAYLOAD.size  # bytes after the block's sequence word
_FIELD_NAMES = tuple(f.name for f in fields(WorkerState))
_get_published = operator.attrgetter(*_FIELD_NAMES[2:])  # everything but the stamped heartbeat
assert len(PAYLOAD_FORMAT) == len(_FIELD_NAMES) and 8 + _PAYLOAD.size <= BLOCK_STRIDE


def payload_table() -> str:
    """The payload rows of the layout table above (offset, size, name, type), generated from the
    code; a test checks that the module docstring starts its payload lines with exactly these."""
    names = {v: k for k, v in _FIELD_FORMATS.items()}
    rows, offset = [], 8
    for name, code in zip(_FIELD_NAMES, PAYLOAD_FORMAT):
        size = struct.calcsize("<" + code)
        rows.append(f"    {offset:3d}   {size}  {name:<17}{names[code]}")
        offset += size
    return "\n".join(rows)


def _role_index(role: str | Role) -> int:
    try:
        return ROLES.index(Role(role).block.value)
    except ValueError:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}") from None


class StateBuffer:
    """Handle on one instance's state buffer. Each worker publishes only its own role."""

    def __init__(self, segment: Segment):
        self._segment = segment
        self._region = SharedRegion(segment.mm)
        self._beats: dict[str, int] = {}
        (_, self.layout_version, _, _, _, self.created_ns, self.creator_pid, _,
         raw_id) = _HEADER.unpack_from(segment.mm, 0)
        self.instance_id = raw_id.rstrip(b"\0").decode("ascii")

    @classmethod
    def create(cls, instance_id: str) -> StateBuffer:
        seg = create_segment(instance_id, SEGMENT_ROLE, SEGMENT_SIZE)
        _HEADER.pack_into(seg.mm, 0, b"\0" * 8, LAYOUT_VERSION, HEADER_SIZE, BLOCK_STRIDE, len(ROLES),
                          time.time_ns(), os.getpid(), 0, instance_id.encode("ascii"))
        region = SharedRegion(seg.mm)
        region.store_u64(0, int.from_bytes(MAGIC, "little"))  # release: publishes the header above
        region.release()
        return cls(seg)

    @classmethod
    def attach(cls, instance_id: str, timeout: float = 1.0) -> StateBuffer:
        seg = attach_segment(instance_id, SEGMENT_ROLE)
        try:
            _validate(seg, timeout)
        except BaseException:
            seg.close()
            raise
        return cls(seg)

    # -- per-worker blocks -----------------------------------------------------------------------

    def publish(self, role: str, state: WorkerState) -> int:
        """Write `state` as `role`'s block, stamping heartbeat_ns and heartbeat_count (the caller's
        object is not modified); returns the heartbeat count written."""
        offset = HEADER_SIZE + BLOCK_STRIDE * _role_index(role)
        beats = self._beats.get(role)
        if beats is None:
            # Continue the count of a previous writer of this role (a restarted worker). Read it without
            # the seqlock: we are now the only writer, and the old one may have died mid-write.
            beats = _HEARTBEAT_COUNT.unpack_from(self._segment.mm, offset + 16)[0]
        beats += 1
        self._beats[role] = beats
        self._region.seqlock_write(offset, _PAYLOAD.pack(time.monotonic_ns(), beats, *_get_published(state)))
        return beats

    def read(self, role: str, timeout: float = 1.0) -> WorkerState:
        """A consistent snapshot of `role`'s block. Raises SeqlockTimeout if the block stays mid-write
        for `timeout` s (its writer died inside publish)."""
        offset = HEADER_SIZE + BLOCK_STRIDE * _role_index(role)
        return WorkerState(*_PAYLOAD.unpack(self._region.seqlock_read(offset, _PAYLOAD.size, timeout)))

    def version(self, role: str) -> int:
        """The block's sequence number: changes with every publish, so a reader can skip unchanged
        state with one atomic load."""
        return self._region.load_u64(HEADER_SIZE + BLOCK_STRIDE * _role_index(role))

    # -- launcher -> workers control bits ------------------------------------------------------

    def control(self) -> ControlFlags:
        return ControlFlags(self._region.load_u64(_CONTROL_OFFSET))

    def set_control(self, bits: ControlFlags) -> ControlFlags:
        return ControlFlags(self._region.fetch_or_u64(_CONTROL_OFFSET, int(bits)))

    def clear_control(self, bits: ControlFlags) -> ControlFlags:
        return ControlFlags(self._region.fetch_and_u64(_CONTROL_OFFSET, ~int(bits) & (2**64 - 1)))

    # -- raw access for benchmarks -------------------------------------------------------------

    @property
    def region(self) -> SharedRegion:
        return self._region

    @staticmethod
    def block_offset(role: str) -> int:
        return HEADER_SIZE + BLOCK_STRIDE * _role_index(role)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._segment.name

    def close(self) -> None:
        self._region.release()
        self._segment.close()

    def unlink(self) -> None:
        """Remove the name (the creator does this; mappings elsewhere stay valid until closed)."""
        self._segment.unlink()

    def __enter__(self) -> StateBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _validate(seg: Segment, timeout: float) -> None:
    region = SharedRegion(seg.mm)
    try:
        deadline = time.monotonic() + timeout
        while region.load_u64(0) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the creator has not finished writing the header yet
        magic = region.load_u64(0).to_bytes(8, "little")
    finally:
        region.release()
    if magic != MAGIC:
        raise StateBufferLayoutError(f"{seg.name} is not a Bullet state buffer (magic {magic!r}, expected {MAGIC!r})")
    _, version, header_size, stride, blocks, *_ = _HEADER.unpack_from(seg.mm, 0)
    if (version, header_size, stride, blocks) != (LAYOUT_VERSION, HEADER_SIZE, BLOCK_STRIDE, len(ROLES)):
        raise StateBufferLayoutError(
            f"{seg.name} has state-buffer layout version {version} (header {header_size} B, blocks "
            f"{blocks}x{stride} B); this code reads version {LAYOUT_VERSION} (header {HEADER_SIZE} B, blocks "
            f"{len(ROLES)}x{BLOCK_STRIDE} B): the server and this process come from different Bullet versions")


__all__ = ["StateBuffer", "WorkerState", "WorkerFlags", "ControlFlags", "StateBufferLayoutError",
           "SeqlockTimeout", "LAYOUT_VERSION", "ROLES"]
