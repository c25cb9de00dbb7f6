"""The two-process runtime end to end: a real `bullet launch` (launcher + prefill worker + decode
worker), real sockets and shared memory, the real model."""

from __future__ import annotations

import concurrent.futures as cf
import random

import pytest

from tests.server_utils import ServerProcess, bullet_segments, wait_pages_accounted

TEXT = ("The history of computing is a story of people who wanted machines to do their arithmetic. Early "
        "mechanical calculators could add and subtract; later ones multiplied. In the nineteenth century Charles "
        "Babbage designed an engine that could be programmed with punched cards, and Ada Lovelace wrote what many "
        "call the first program for it. A century later, electronic computers filled rooms, consumed enormous "
        "power and were programmed by rewiring. The invention of the transistor and then the integrated circuit "
        "made them smaller, cheaper and faster every year, until a computer fit in a pocket. ") * 3


def mixed_requests(tokenizer, n: int = 32, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_new_tokens) of mixed lengths: slices of real text, 4..300 tokens."""
    ids = tokenizer.encode(TEXT)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([4, 9, 17, 33, 64, 120, 200, 300])
        start = rng.randrange(0, len(ids) - length)
        out.append((ids[start : start + length], rng.choice([6, 12, 24])))
    return out


@pytest.fixture(scope="module")
def server(fp32_srm_profile):
    with ServerProcess("--dtype", "float32", "--estimator-profile", fp32_srm_profile) as s:  # default pool: 32768 tokens
        yield s


@pytest.fixture(scope="module")
def offline():
    import bullet

    return bullet.LLM(dtype="float32", max_total_tokens=20000)


def test_32_concurrent_requests_match_the_offline_api_and_free_every_page(server, offline):
    reqs = mixed_requests(offline.tokenizer)
    assert len({len(p) for p, _ in reqs}) >= 6

    def one(item):
        prompt, n = item
        return server.post("/generate", {"input_ids": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})

    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(one, reqs))
    expected = offline.generate([p for p, _ in reqs],
                                [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for _, n in reqs])
    for (status, body), exp, (prompt, n) in zip(results, expected, reqs):
        assert status == 200, body
        assert body["meta_info"]["completion_tokens"] == n
        assert body["output_ids"] == exp.output_ids, f"prompt of {len(prompt)} tokens diverged"
    state = wait_pages_accounted(server)  # every page free, or cached with no request using it
    assert state["prefill"]["queued_requests"] == 0 and state["decode"]["batch_size"] == 0


def _pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise AssertionError(f"no Pss line for {pid}")


def test_weights_and_pool_are_mapped_not_copied(server):
    """Three processes map one copy: summed PSS stays under 1.5x weights + pool."""
    status, info = server.get("/server_info")
    pids = [server.proc.pid, *server.worker_pids().values()]
    # fault in the whole KV pool in both workers: a long request touches many pages in each
    server.post("/generate", {"text": TEXT * 2, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    weights_kb = info["internal_states"][0]["weight_bytes"] / 1024
    pool_kb = info["internal_states"][0]["kv_bytes"] / 1024
    total = sum(_pss_kb(p) for p in pids)
    print(f"PSS launcher+workers = {total / 1024:.0f} MB; weights {weights_kb / 1024:.0f} MB + pool "
          f"{pool_kb / 1024:.0f} MB = {(weights_kb + pool_kb) / 1024:.0f} MB; ratio {total / (weights_kb + pool_kb):.2f}")
    assert total < 1.5 * (weights_kb + pool_kb)
    # and every process maps the same shared-memory objects for the weights
    maps = [open(f"/proc/{p}/maps").read() for p in pids]
    shared_objects = [set(line.split()[-1] for line in m.splitlines() if "torch_" in line) for m in maps]
    assert shared_objects[0] and shared_objects[0] == shared_objects[1] == shared_objects[2]


def test_two_servers_side_by_side_do_not_touch_each_other(server, fp32_srm_profile):
    with ServerProcess("--dtype", "float32", "--max-total-tokens", "4096", "--estimator-profile", fp32_srm_profile) as other:
        assert other.instance_id != server.instance_id
        mine, theirs = set(bullet_segments(server.instance_id)), set(bullet_segments(other.instance_id))
        assert mine and theirs and not mine & theirs
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        a, b = server.post("/generate", body), other.post("/generate", body)
        assert a[0] == b[0] == 200 and a[1]["output_ids"] == b[1]["output_ids"]
        assert other.state()["kv_pages_total"] != server.state()["kv_pages_total"]
    # the other server is gone, with its segments; this one still serves
    assert bullet_segments(server.instance_id) and server.get("/health")[0] == 200
