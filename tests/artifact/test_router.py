"""Scale-out behind SGLang's own router (issue 16): two replicas on the loopback, each pinned to one
core (`--cores`), behind `sglang-router`. Under round-robin, requests spread over both replicas;
under the cache-aware policy (SGLang's default), requests that share a prefix go to the same one
(the router's prefix tree, which a prefix cache would turn into reuse); a killed replica is routed
around — every request still gets an answer, the router retrying on the survivor — and leaves no
process or shared-memory segment behind."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from tests.frontend.helpers import metric_sum
from tests.server_utils import ServerProcess, bullet_segments, pid_alive

pytest.importorskip("sglang_router")
from artifact.router import SGLangRouter  # noqa: E402  (needs sglang_router)

# what is routed where does not depend on the policy; `static` spares each one-core replica an
# estimator profile of its own (measured once per core count on a fresh machine)
REPLICA_ARGS = ("--max-total-tokens", "4096", "--policy", "static")


@pytest.fixture(scope="module")
def replicas():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores, one per replica")
    cores = sorted(os.sched_getaffinity(0))[:2]
    with ServerProcess(*REPLICA_ARGS, "--cores", str(cores[0])) as a, \
            ServerProcess(*REPLICA_ARGS, "--cores", str(cores[1])) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def round_robin(replicas):
    with SGLangRouter([r.url for r in replicas], "round_robin") as r:
        yield r


@pytest.fixture(scope="module")
def cache_aware(replicas):
    with SGLangRouter([r.url for r in replicas], "cache_aware") as r:
        yield r


def generate(router, text: str, max_new_tokens: int = 2) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(router.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def served(replica) -> float:
    return metric_sum(replica.get("/metrics")[1], "sglang:num_requests_total")


def test_each_replica_runs_on_its_own_core(replicas):
    cores = [r.get("/server_info")[1]["cores"] for r in replicas]
    assert cores[0] != cores[1] and all(c is not None for c in cores)


def test_different_prompts_spread_over_both_replicas(round_robin, replicas):
    router = round_robin
    before = [served(r) for r in replicas]
    topics = ["apples", "the ocean", "trains", "winter", "music", "chess", "bread", "rivers"]
    for i, topic in enumerate(topics):
        out = generate(router, f"{i} A short note about {topic}:")
        assert out["meta_info"]["completion_tokens"] == 2
    got = [served(r) - b for r, b in zip(replicas, before)]
    assert got == [len(topics) / 2] * 2, f"requests per replica: {got}"


def test_a_shared_prefix_goes_to_one_replica(cache_aware, replicas):
    """Cache-aware routing: once a replica has served a prefix, requests that extend it follow."""
    router = cache_aware
    prefix = "You are a helpful assistant who answers in one word. Question number "
    before = [served(r) for r in replicas]
    for i in range(6):
        generate(router, f"{prefix}{i}: what colour is the sky?")
    got = [served(r) - b for r, b in zip(replicas, before)]
    assert sorted(got) == [0, 6], f"requests per replica: {got}"


@pytest.fixture
def victim_and_router(replicas):
    """A third replica (on the first replica's core) and a round-robin router over it and the second
    replica: the test kills the victim, and the module's replicas and routers stay as they were (the
    tests run in any order)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    with ServerProcess(*REPLICA_ARGS, "--cores", str(cores[0])) as victim, \
            SGLangRouter([victim.url, replicas[1].url], "round_robin") as router:
        yield victim, replicas[1], router


def test_a_killed_replica_is_routed_around(victim_and_router):
    """Round-robin would send every other request to the dead replica: each must still succeed."""
    victim, survivor, router = victim_and_router
    pids = list(victim.worker_pids().values())
    instance = victim.instance_id
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    before = served(survivor)
    for i in range(6):  # each answered: the router retries a request the dead replica refused
        assert generate(router, f"{i} After the crash, a note about topic {i}:")["meta_info"]["completion_tokens"] == 2
    assert served(survivor) - before == 6
    deadline = time.monotonic() + 15
    while victim.url in router.healthy_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim.url not in router.healthy_workers()
    # the killed launcher took its workers and its segments with it
    deadline = time.monotonic() + 15
    while (any(pid_alive(p) for p in pids) or bullet_segments(instance)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids) and not bullet_segments(instance), victim.tail()
