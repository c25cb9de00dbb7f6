"""The cpu backend in a real child process: after each apply, every thread's Cpus_allowed_list (read
here from /proc, independently of the child) must be exactly the share, and torch's intra-op thread
count must match it — while the child keeps a torch matmul loop running between applies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bullet.doctor.cpu_check import CpuProbeChild
from bullet.partition import make_backend

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs at least 2 allowed cores")


def allowed_cpus_per_thread(pid: int) -> dict[int, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split()[1]
    return out


def expand(cpus) -> str:
    """The kernel's list syntax for a set of cpu ids, written independently of the backend."""
    ids = sorted(cpus)
    if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def assert_share(child: CpuProbeChild, reply: dict, cores: list[int]) -> None:
    threads = allowed_cpus_per_thread(child.pid)
    assert len(threads) >= 2  # at least main + an idle helper: more than the calling thread
    assert set(threads.values()) == {expand(cores)}, threads
    assert reply["current_units"] == len(cores) and reply["unit_set"] == cores
    assert reply["torch_threads"] == len(cores)


@needs_two_cores
def test_shrink_and_grow_repeatedly_while_matmul_runs():
    low, high = ALLOWED[:1], ALLOWED[-1:]
    with CpuProbeChild("decode") as decode, CpuProbeChild("prefill") as prefill:
        last_iterations = -1
        for units in (1, len(ALLOWED), 1, len(ALLOWED), 1):
            reply = decode.send(f"apply {units}")
            assert_share(decode, reply, ALLOWED[-units:])
            assert reply["iterations"] > last_iterations  # the matmul loop kept going
            last_iterations = reply["iterations"]
        reply = prefill.send("apply 1")
        assert_share(prefill, reply, low)
        # disjoint cores for the two workers, as the policy would run them
        assert set(allowed_cpus_per_thread(prefill.pid).values()) == {expand(low)}
        assert set(allowed_cpus_per_thread(decode.pid).values()) == {expand(high)}
        assert reply["apply_cost"]["count"] == 1
        # torch's intra-op pool threads exist beside main and the idle helper, and were pinned too
        assert len(allowed_cpus_per_thread(decode.pid)) >= 3
        # a thread created after apply inherits the share
        before = decode.send("apply 1")
        after = decode.send("spawn")
        assert len(after["tids"]) == len(before["tids"]) + 1
        assert set(allowed_cpus_per_thread(decode.pid).values()) == {expand(high)}


@needs_two_cores
def test_units_index_the_cores_allowed_at_start():
    # start the child already restricted (as taskset or a cgroup would): units index that list
    only = ALLOWED[-1]
    with CpuProbeChild("prefill", preexec_fn=lambda: os.sched_setaffinity(0, {only})) as child:
        assert child.ready["total_units"] == 1
        reply = child.send("apply 1")
        assert_share(child, reply, [only])


def test_explicit_core_list_and_describe():
    b = make_backend("cpu", "decode", cores=[ALLOWED[0]], set_torch_threads=False)
    assert b.total_units == 1 and b.unit_set() == {ALLOWED[0]}
    d = b.describe()
    assert d["backend"] == "cpu" and d["allowed_cores"] == [ALLOWED[0]] and d["unit_kind"] == "core"


def test_tensor_parallel_ranks_split_their_workers_share_into_contiguous_runs():
    from bullet.partition.cpu import rank_part

    share = range(2, 9)  # 7 cores of a worker's share
    parts = [rank_part(share, r, 3) for r in range(3)]
    assert [list(p) for p in parts] == [[2, 3, 4], [5, 6], [7, 8]]  # every core once, the larger runs first
    assert rank_part(share, 0, 1) == share
    # fewer cores than ranks: each rank shares one of them, none is left without a core
    assert [list(rank_part(range(4, 6), r, 4)) for r in range(4)] == [[4], [5], [4], [5]]
    assert list(rank_part(range(0), 1, 2)) == []
