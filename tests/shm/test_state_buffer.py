"""State buffer: layout, API, isolation between instances, and tear-freedom under a real concurrent
writer process (real POSIX shared memory, spawn-context processes)."""

from __future__ import annotations

import multiprocessing as mp
import operator
import os
import struct
import time
from dataclasses import fields

import pytest

import bullet.shm.state_buffer as sbmod
from bullet.shm import segments as shm
from bullet.shm.state_buffer import (ControlFlags, SeqlockTimeout, StateBuffer, StateBufferLayoutError, WorkerFlags,
                                 WorkerState)

SPAWN = mp.get_context("spawn")
STRESS_UPDATES = 1_000_000


@pytest.fixture
def iid():
    """A fresh instance id; after the test, asserts that nothing this process created is left in
    /dev/shm (and removes it either way)."""
    before = {i.instance_id for i in shm.list_instances()}
    instance_id = shm.new_instance_id()
    yield instance_id
    mine = {i.instance_id for i in shm.list_instances() if i.creator_pid == os.getpid()} - before
    leaked = {i: shm.segments_of(i) for i in mine | {instance_id} if shm.segments_of(i)}
    for i in leaked:
        shm.cleanup_instance(i)
    assert not leaked, f"test leaked shared memory: {leaked}"


def _all_fields(value: int) -> WorkerState:
    """A state whose every published field (everything publish() does not stamp) equals `value`."""
    return WorkerState(0, 0, *([value] * (len(fields(WorkerState)) - 2)))


def test_publish_read_round_trip_and_heartbeat(iid):
    sb = StateBuffer.create(iid)
    try:
        assert sb.read("prefill") == WorkerState() and sb.read("decode") == WorkerState()
        st = WorkerState(pid=os.getpid(), step=7, flags=WorkerFlags.READY | WorkerFlags.PAUSED, batch_size=3,
                         queued_requests=4, queued_tokens=2**40, tokens_in_flight=512, remaining_layers=11,
                         ttft_pred_p90_ms=1.5, ttft_obs_ms=2.25, tpot_pred_p90_ms=40.0, tpot_obs_ms=38.5,
                         step_pred_ms=0.125, step_obs_ms=0.25)
        st.set_units([0, 5, 63, 64, 127])
        v0 = sb.version("prefill")
        t0 = time.monotonic_ns()
        assert sb.publish("prefill", st) == 1
        got = sb.read("prefill")
        assert t0 <= got.heartbeat_ns <= time.monotonic_ns() and got.heartbeat_count == 1
        assert (got.heartbeat_ns, got.heartbeat_count) != (st.heartbeat_ns, st.heartbeat_count)  # caller's object untouched
        got.heartbeat_ns, got.heartbeat_count = st.heartbeat_ns, st.heartbeat_count
        assert got == st
        assert got.units() == [0, 5, 63, 64, 127] and got.compute_units == 5
        assert WorkerFlags(got.flags) == WorkerFlags.READY | WorkerFlags.PAUSED
        assert sb.version("prefill") == v0 + 2 and sb.version("prefill") % 2 == 0
        assert sb.read("decode") == WorkerState()  # the other role's block is untouched
        assert sb.publish("prefill", st) == 2
    finally:
        sb.close()
        sb.unlink()


def test_header_fields_and_control_bits(iid):
    sb = StateBuffer.create(iid)
    other = StateBuffer.attach(iid)
    try:
        assert (other.instance_id, other.creator_pid, other.layout_version) == (iid, os.getpid(), sbmod.LAYOUT_VERSION)
        assert abs(other.created_ns - time.time_ns()) < 60e9
        assert other.control() == ControlFlags(0)
        spare = 1 << 7  # the word is a plain atomic bit set: bits other than SHUTDOWN are kept as they are
        sb.set_control(ControlFlags(spare))
        assert other.set_control(ControlFlags.SHUTDOWN) == spare
        assert sb.control() == spare | ControlFlags.SHUTDOWN
        sb.clear_control(ControlFlags(spare))
        assert other.control() == ControlFlags.SHUTDOWN
    finally:
        other.close()
        sb.close()
        sb.unlink()


def test_restarted_writer_continues_heartbeat_count(iid):
    sb = StateBuffer.create(iid)
    try:
        for _ in range(3):
            sb.publish("decode", WorkerState())
        successor = StateBuffer.attach(iid)
        assert successor.publish("decode", WorkerState()) == 4
        successor.close()
    finally:
        sb.close()
        sb.unlink()


def test_unknown_role_is_rejected(iid):
    with StateBuffer.create(iid) as sb:
        with pytest.raises(ValueError, match="role"):
            sb.read("encode")
        sb.unlink()


def test_attach_rejects_wrong_magic_and_version(iid):
    seg = shm.create_segment(iid, "state", 4096)
    seg.mm[:8] = b"NOTMAGIC"
    with pytest.raises(StateBufferLayoutError, match="not a Bullet state buffer"):
        StateBuffer.attach(iid)
    seg.close()
    seg.unlink()

    sb = StateBuffer.create(iid)
    struct.pack_into("<I", sb._segment.mm, 8, sbmod.LAYOUT_VERSION + 1)
    with pytest.raises(StateBufferLayoutError, match=f"version {sbmod.LAYOUT_VERSION + 1}"):
        StateBuffer.attach(iid)
    sb.close()
    sb.unlink()


def test_attach_to_missing_instance_is_a_clear_error(iid):
    with pytest.raises(FileNotFoundError, match=f"bullet-{iid}-state"):
        StateBuffer.attach(iid)


def test_dead_writer_mid_write_times_out_then_recovers(iid):
    sb = StateBuffer.create(iid)
    try:
        offset = StateBuffer.block_offset("decode")
        sb.region.store_u64(offset, sb.version("decode") + 1)  # a writer that died with the sequence odd
        t0 = time.monotonic()
        with pytest.raises(SeqlockTimeout):
            sb.read("decode", timeout=0.05)
        assert time.monotonic() - t0 < 2.0
        sb.publish("decode", _all_fields(9))  # the next writer makes the block consistent again
        assert sb.read("decode").batch_size == 9 and sb.version("decode") % 2 == 0
    finally:
        sb.close()
        sb.unlink()


def test_layout_docstring_matches_code():
    doc = sbmod.__doc__.splitlines()
    rows = sbmod.payload_table().splitlines()
    positions = [next(i for i, line in enumerate(doc) if line.startswith(row)) for row in rows]
    assert positions == sorted(positions)
    assert struct.calcsize("<" + sbmod.PAYLOAD_FORMAT) == 188 - 8  # the table ends at 188


def test_two_instances_side_by_side(iid):
    second = shm.new_instance_id()
    a, b = StateBuffer.create(iid), StateBuffer.create(second)
    try:
        assert a.name != b.name
        a.publish("decode", _all_fields(1))
        b.publish("decode", _all_fields(2))
        a2 = StateBuffer.attach(iid)
        assert a2.read("decode").batch_size == 1 and b.read("decode").batch_size == 2
        a2.close()
        assert shm.segments_of(iid) == [f"bullet-{iid}-state"]
        assert shm.segments_of(second) == [f"bullet-{second}-state"]
        shm.cleanup_instance(iid)
        assert shm.segments_of(iid) == [] and shm.segments_of(second) == [f"bullet-{second}-state"]
        assert b.read("decode").batch_size == 2
    finally:
        a.close()
        b.close()
        shm.cleanup_instance(second)


def test_shared_region_word_atomics_and_bounds():
    import mmap

    from bullet._shmatomic import SharedRegion

    mm = mmap.mmap(-1, 4096)
    region = SharedRegion(mm)
    assert region.size == 4096
    assert region.fetch_add_u64(8, 5) == 0 and region.fetch_add_u64(8, -1) == 5 and region.load_u64(8) == 4
    assert region.compare_exchange_u64(8, 3, 9) == (False, 4)
    assert region.compare_exchange_u64(8, 4, 9) == (True, 4) and region.load_u64(8) == 9
    assert region.fetch_or_u64(16, 0b101) == 0 and region.fetch_and_u64(16, 0b100) == 0b101
    region.store_u64(16, 2**64 - 1)
    assert region.load_u64(16) == 2**64 - 1
    with pytest.raises(ValueError, match="aligned"):
        region.load_u64(4)
    with pytest.raises(IndexError):
        region.seqlock_write(4088, b"x")  # 8-byte sequence word + 1 byte does not fit
    with pytest.raises(ValueError):
        region.seqlock_read(0, -1)
    region.seqlock_write(24, b"odd-sized payload")
    assert region.seqlock_read(24, 17) == b"odd-sized payload" and region.load_u64(24) == 2
    with pytest.raises(BufferError):
        mm.close()  # the region pins the mapping, so its raw pointer cannot dangle
    region.release()
    mm.close()
    with pytest.raises(ValueError, match="released"):
        region.load_u64(0)


# ---- tearing stress: a writer process and a checking reader ----------------------------------
#
# The writer publishes 1, 2, 3, ... until told to stop; the reader (this process) checks every read
# and stops the writer once it has published at least STRESS_UPDATES values *and* the reader has
# seen enough distinct values to prove the two really overlapped (on a loaded machine the two may
# share one core, where overlap only happens at context switches).

MIN_DISTINCT = 1000
STRESS_DEADLINE_S = 120


def _publish_counter(instance_id: str, role: str) -> None:
    sb = StateBuffer.attach(instance_id)
    i = 0
    while not sb.control() & ControlFlags.SHUTDOWN:
        for _ in range(1000):
            i += 1
            # every field after the two stamped by publish() carries the same counter
            sb.publish(role, WorkerState(0, 0, *([i] * (len(fields(WorkerState)) - 2))))
    sb.close()


_published = operator.attrgetter(*(f.name for f in fields(WorkerState)[1:]))  # all but heartbeat_ns


def test_no_torn_reads_under_concurrent_writer_1m_updates(iid):
    sb = StateBuffer.create(iid)
    writer = SPAWN.Process(target=_publish_counter, args=(iid, "decode"))
    reads = torn = regressions = 0
    distinct, last = set(), 0
    t0 = time.monotonic()
    try:
        writer.start()
        while last < STRESS_UPDATES or len(distinct) < MIN_DISTINCT:
            values = _published(sb.read("decode"))
            reads += 1
            if reads % 10_000 == 0 and time.monotonic() - t0 > STRESS_DEADLINE_S:
                break  # checked before `continue`: a broken writer must fail the test, not hang it
            if len(set(values)) != 1:  # every field of one publish carries the same counter
                torn += 1
                continue
            if values[0] < last:
                regressions += 1
            last = values[0]
            distinct.add(last)
            if reads % 10_000 == 0 and (not writer.is_alive() or time.monotonic() - t0 > STRESS_DEADLINE_S):
                break
        sb.set_control(ControlFlags.SHUTDOWN)
        writer.join(60)
        final = _published(sb.read("decode"))
        print(f"\n{final[0]} updates, {reads} checked reads, {len(distinct)} distinct values seen, "
              f"{torn} torn, {time.monotonic() - t0:.1f} s")
        assert writer.exitcode == 0 and len(set(final)) == 1 and final[0] >= STRESS_UPDATES
        assert torn == 0 and regressions == 0
        assert len(distinct) >= MIN_DISTINCT, "reader and writer barely overlapped: the test proved nothing"
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join()
        sb.close()
        sb.unlink()


_STOP_WORD = 2048  # outside the 1 KiB block


def _raw_writer(instance_id: str, words: int) -> None:
    from bullet._shmatomic import SharedRegion

    seg = shm.attach_segment(instance_id, "state")
    region, i = SharedRegion(seg.mm), 0
    while not region.load_u64(_STOP_WORD):
        for _ in range(1000):
            i += 1
            region.seqlock_write(0, i.to_bytes(8, "little") * words)
    region.release()
    seg.close()


def test_no_torn_reads_raw_1kib_block(iid):
    """The C seqlock alone, with a 1 KiB payload (a copy long enough to be overlapped often)."""
    from bullet._shmatomic import SharedRegion

    words = 128
    seg = shm.create_segment(iid, "state", 4096)
    region = SharedRegion(seg.mm)
    writer = SPAWN.Process(target=_raw_writer, args=(iid, words))
    reads = torn = 0
    distinct, last = set(), 0
    t0 = time.monotonic()
    try:
        writer.start()
        while last < STRESS_UPDATES or len(distinct) < MIN_DISTINCT:
            data = region.seqlock_read(0, 8 * words)
            reads += 1
            if data != data[:8] * words:
                torn += 1
                continue
            last = int.from_bytes(data[:8], "little")
            distinct.add(last)
            if reads % 10_000 == 0 and (not writer.is_alive() or time.monotonic() - t0 > STRESS_DEADLINE_S):
                break
        region.store_u64(_STOP_WORD, 1)
        writer.join(60)
        print(f"\nraw: {last} updates, {reads} reads, {len(distinct)} distinct, {torn} torn")
        assert writer.exitcode == 0 and last >= STRESS_UPDATES
        assert torn == 0 and len(distinct) >= MIN_DISTINCT
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join()
        region.release()
        seg.close()
        seg.unlink()


def test_an_h200s_132_sms_fit_the_unit_set(iid):
    """SM ids 128-131 (the last of an H200's 132) reach the peer: the layout's unit set holds ids 0-191."""
    sb = StateBuffer.create(iid)
    try:
        state = WorkerState()
        state.set_units(range(64, 132))
        sb.publish("decode", state)
        got = sb.read("decode")
        assert got.units() == list(range(64, 132)) and got.compute_units == 68 and got.unit_mask_ext == 0b1111
        with pytest.raises(ValueError, match="outside"):
            state.set_units([192])
    finally:
        sb.close()
        sb.unlink()
