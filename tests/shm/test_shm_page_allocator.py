"""Shared page allocator: same answers as LocalPageAllocator, safe under two real processes, and
not deadlocked by a process that dies holding its lock."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from bullet.shm import segments as shm
from bullet._shmatomic import SharedRegion
from bullet.shm.page_allocator import LocalPageAllocator, OutOfPages
from bullet.shm.shared_page_allocator import SharedPageAllocator

SPAWN = mp.get_context("spawn")


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


@pytest.fixture
def pages(iid):
    alloc = SharedPageAllocator.create(iid, 16, 4)
    yield alloc
    alloc.close()
    alloc.unlink()


def test_alloc_free_and_owner_reclaim(pages):
    assert (pages.total_pages, pages.page_size, pages.num_free()) == (16, 4, 16)
    assert pages.pages_for(9) == 3 and pages.alloc(0, 1) == []
    a = pages.alloc(3, owner=1)
    b = pages.alloc(2, owner=2)
    assert a == [0, 1, 2] and b == [3, 4] and pages.num_free() == 11
    with pytest.raises(ValueError):
        pages.free(b, owner=1)  # not its pages
    with pytest.raises(ValueError):
        pages.free([a[0], a[0]], owner=1)  # duplicates would corrupt the free list
    with pytest.raises(ValueError):
        pages.free([99], owner=1)
    with pytest.raises(ValueError):
        pages.alloc(1, owner=-1)
    assert pages.num_free() == 11
    pages.free([a[1]], owner=1)
    assert pages.alloc(1, owner=3) == [a[1]]  # last freed is first reused, as in LocalPageAllocator
    assert pages.free_owner(1) == 2 and pages.free_owner(1) == 0
    assert pages.pages_of(2) == b
    assert pages.free_owner(2) == 2 and pages.free_owner(3) == 1
    assert pages.num_free() == 16
    pages.check_invariants()


def test_out_of_pages_is_all_or_nothing(pages):
    held = pages.alloc(10, owner=5)
    with pytest.raises(OutOfPages):
        pages.alloc(7, owner=6)
    assert pages.num_free() == 6 and pages.pages_of(6) == [] and pages.pages_of(5) == held
    assert len(pages.alloc(6, owner=6)) == 6 and pages.num_free() == 0
    pages.check_invariants()


def test_attached_process_view_and_layout_check(iid, pages):
    other = SharedPageAllocator.attach(iid)
    try:
        got = other.alloc(4, owner=8)
        assert pages.num_free() == 12 and pages.pages_of(8) == got
        assert (other.total_pages, other.page_size) == (16, 4)
    finally:
        other.close()
    with pytest.raises(FileNotFoundError):
        SharedPageAllocator.attach(shm.new_instance_id())
    with pytest.raises(ValueError):
        SharedPageAllocator.create(shm.new_instance_id(), 0, 16)


def test_attach_rejects_a_segment_that_is_not_an_allocator(iid):
    seg = shm.create_segment(iid, "pages", 4096)
    try:
        seg.mm[:8] = b"BULLETSB"
        with pytest.raises(RuntimeError, match="not a Bullet page allocator"):
            SharedPageAllocator.attach(iid, timeout=0.05)
    finally:
        seg.close()
        seg.unlink()


def test_lock_errors_are_reported_not_deadlocked(pages):
    pages._mutex.acquire()
    try:
        with pytest.raises(RuntimeError, match="already held"):
            pages._mutex.acquire()  # error-checking mutex: relocking is an error, not a hang
        outcome = []
        t = threading.Thread(target=lambda: outcome.append(_try_lock(pages, 0.1)))
        t.start()
        t.join(10)
        assert outcome == ["timeout"]
    finally:
        pages._mutex.release()
    with pytest.raises(RuntimeError, match="does not hold"):
        pages._mutex.release()


def _try_lock(pages, timeout):
    try:
        pages._mutex.acquire(timeout=timeout)
    except TimeoutError:
        return "timeout"
    pages._mutex.release()
    return "acquired"


# ---- two processes at once ------------------------------------------------------------------------

def _churn(instance_id: str, me: int, iterations: int, seed: int, results) -> None:
    """Random alloc/free/free_owner; every page handed out is claimed in a shared claim table with a
    compare-exchange, which fails if the other process holds the same page."""
    alloc = SharedPageAllocator.attach(instance_id)
    seg = shm.attach_segment(instance_id, "claims")
    claims = SharedRegion(seg.mm)
    rng = random.Random(seed)
    held: dict[int, list[int]] = {}  # owner -> pages
    stats = {"allocs": 0, "out_of_pages": 0, "double_handouts": 0, "lost_claims": 0}

    def release(owner, pages):
        for p in pages:
            ok, _ = claims.compare_exchange_u64(8 * p, me, 0)
            stats["lost_claims"] += not ok

    for _ in range(iterations):
        op = rng.random()
        if op < 0.55 or not held:
            owner = me * 1_000_000 + rng.randrange(50)
            try:
                got = alloc.alloc(rng.randint(1, 6), owner)
            except OutOfPages:
                stats["out_of_pages"] += 1
                continue
            stats["allocs"] += 1
            for p in got:
                ok, _ = claims.compare_exchange_u64(8 * p, 0, me)
                stats["double_handouts"] += not ok
            held.setdefault(owner, []).extend(got)
        elif op < 0.9:
            owner = rng.choice(list(held))
            some = rng.sample(held[owner], rng.randint(1, len(held[owner])))
            release(owner, some)
            alloc.free(some, owner)
            held[owner] = [p for p in held[owner] if p not in some]
            if not held[owner]:
                del held[owner]
        else:
            owner = rng.choice(list(held))
            release(owner, held[owner])
            assert alloc.free_owner(owner) == len(held.pop(owner))
    for owner, pages in held.items():
        release(owner, pages)
        assert alloc.free_owner(owner) == len(pages)
    claims.release()
    seg.close()
    alloc.close()
    results.put((me, stats))


def test_two_processes_never_share_a_page_and_end_all_free(iid):
    total = 48
    alloc = SharedPageAllocator.create(iid, total, 16)
    seg = shm.create_segment(iid, "claims", 8 * total)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_churn, args=(iid, me, 4000, me, results)) for me in (1, 2)]
    try:
        for p in procs:
            p.start()
        stats = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        print(f"\n{stats}")
        assert all(s["double_handouts"] == 0 and s["lost_claims"] == 0 for s in stats.values())
        assert all(s["allocs"] > 500 and s["out_of_pages"] > 0 for s in stats.values()), "too little contention"
        assert alloc.num_free() == total and alloc.recoveries == 0
        alloc.check_invariants()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        seg.close()
        seg.unlink()
        alloc.close()
        alloc.unlink()


# ---- a process dies holding the lock ----------------------------------------------------------

def _die_mid_alloc(instance_id: str, conn) -> None:
    """Take the lock and get half-way through an allocation for owner 42 (owner written, free count
    not yet), then report and wait to be SIGKILLed."""
    alloc = SharedPageAllocator.attach(instance_id)
    alloc._mutex.acquire()
    top = alloc.num_free()
    alloc._owner[alloc._stack[top - 1]] = 42
    conn.send(alloc._stack[top - 1])
    time.sleep(600)


def _alloc_in_thread(alloc, n, owner, timeout):
    out = []
    t = threading.Thread(target=lambda: out.append(alloc.alloc(n, owner)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "allocator deadlocked after its lock holder died"
    return out[0]


def test_holder_killed_inside_the_lock_does_not_deadlock(iid):
    alloc = SharedPageAllocator.create(iid, 16, 4)
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_die_mid_alloc, args=(iid, child))
    try:
        proc.start()
        half_allocated = parent.recv()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        got = _alloc_in_thread(alloc, 3, owner=7, timeout=20)
        assert alloc.recoveries == 1 and half_allocated not in got
        assert alloc.pages_of(42) == [half_allocated] and alloc.num_free() == 16 - 1 - 3
        alloc.check_invariants()
        assert alloc.free_owner(42) == 1 and alloc.free_owner(7) == 3 and alloc.num_free() == 16
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        alloc.close()
        alloc.unlink()


def _hammer(instance_id: str, owner: int, working) -> None:
    alloc = SharedPageAllocator.attach(instance_id)
    held = 0
    while True:  # large transactions, so that most kills land inside the lock
        pages = alloc.alloc(256, owner)
        working.set()
        alloc.free(pages[1:], owner)
        held += 1
        if held == 64:
            held = 0
            alloc.free_owner(owner)


def test_random_kills_while_hammering_leave_a_consistent_allocator(iid):
    total = 4096
    alloc = SharedPageAllocator.create(iid, total, 4)
    rng = random.Random(0)
    try:
        for round_ in range(4):
            working = SPAWN.Event()
            proc = SPAWN.Process(target=_hammer, args=(iid, 100 + round_, working))
            proc.start()
            assert working.wait(60), "the hammering child never allocated"
            time.sleep(rng.uniform(0.01, 0.1))
            proc.kill()
            proc.join(60)
            assert proc.exitcode == -signal.SIGKILL, "the hammering child failed before it was killed"
            _alloc_in_thread(alloc, 1, owner=1, timeout=20)
            alloc.check_invariants()
            alloc.free_owner(100 + round_)
        print(f"\nlock found abandoned in {alloc.recoveries} of 4 kills")
        assert alloc.recoveries > 0, "no kill landed inside the lock: the test exercised nothing"
        assert alloc.free_owner(1) == 4 and alloc.num_free() == total
    finally:
        alloc.close()
        alloc.unlink()


# ---- model-based property test ----------------------------------------------------------------

TOTAL = 12


class MatchesLocalAllocator(RuleBasedStateMachine):
    """Any sequence of alloc/free/free_owner gives the shared allocator the same results, errors and
    owner table as LocalPageAllocator."""

    def __init__(self):
        super().__init__()
        self.iid = shm.new_instance_id()
        self.shared = SharedPageAllocator.create(self.iid, TOTAL, 8)
        self.model = LocalPageAllocator(TOTAL, 8)

    @rule(n=st.integers(0, TOTAL + 1), owner=st.integers(0, 4))
    def alloc(self, n, owner):
        assert _outcome(self.shared.alloc, n, owner) == _outcome(self.model.alloc, n, owner)

    @rule(owner=st.integers(0, 4), data=st.data())
    def free(self, owner, data):
        mine = [p for p, o in enumerate(self.model._owner) if o == owner]
        candidates = st.sampled_from(mine) if mine else st.nothing()
        pages = data.draw(st.lists(candidates | st.integers(-1, TOTAL), max_size=4))
        assert _outcome(self.shared.free, pages, owner) == _outcome(self.model.free, pages, owner)

    @rule(owner=st.integers(0, 4))
    def free_owner(self, owner):
        assert self.shared.free_owner(owner) == self.model.free_owner(owner)

    @invariant()
    def same_state(self):
        assert self.shared.num_free() == self.model.num_free()
        assert self.shared._owner_np.tolist() == self.model._owner

    def teardown(self):
        self.shared.check_invariants()
        self.shared.close()
        self.shared.unlink()


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (OutOfPages, ValueError) as e:
        return ("error", type(e).__name__)


def test_matches_local_allocator_on_random_sequences(iid):
    run_state_machine_as_test(MatchesLocalAllocator, settings=settings(
        max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
