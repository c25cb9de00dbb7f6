"""`--tp-size 2` served end to end: each worker runs as two processes (rank 0 schedules and samples,
rank 1 follows), each rank holding half of the embedded model's heads and MLP and its own half of the
KV pool, summing through gloo — real processes, real collectives. Greedy outputs must equal the
unsplit model's token for token (fp32; the all-reduce adds partial sums in another order than one GEMM,
far below what changes an argmax over 32 tokens of these prompts) under bullet: a prefill and a decode
worker re-dividing the cores, layer-wise prefill. A rank that dies takes its worker down with it: the
server restarts every rank and serves again."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

from tests.server_utils import ServerProcess, pid_alive, wait_for, wait_pages_accounted

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first", "import numpy as np\n",
           "The quick brown fox", "Water boils at"]
NEW_TOKENS = 32
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """The unsplit model's greedy tokens (the offline API: one process, no ranks)."""
    import bullet

    llm = bullet.LLM(dtype="float32", max_total_tokens=4096)
    return [out.output_ids for out in llm.generate(PROMPTS, [GREEDY] * len(PROMPTS))]


def _generate_all(server, prompts: list[str]) -> list[dict]:
    def one(text):
        status, body = server.post("/generate", {"text": text, "sampling_params": GREEDY})
        assert status == 200, body
        return body

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _assert_served_as_unsplit(server, expected, prompts: int = len(PROMPTS)) -> None:
    for text, body, tokens in zip(PROMPTS, _generate_all(server, PROMPTS[:prompts]), expected):
        assert body["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert body["output_ids"] == tokens, f"{text!r} diverged from the unsplit model"


def _tp_server(policy: str, *extra: str) -> ServerProcess:
    return ServerProcess("--dtype", "float32", "--tp-size", "2", "--policy", policy, "--max-total-tokens", "4096",
                         *extra)


def test_two_ranks_serve_the_unsplit_models_tokens_and_a_dead_rank_restarts_both_workers(expected, fp32_srm_profile):
    """bullet: a prefill and a decode worker of two ranks each (rank i of both shares the i-th shard of
    the weights and of the KV pool). Then SIGKILL of the decode worker's rank 1: every rank of both
    workers is restarted, nothing of the old incarnation survives, and the outputs are the unsplit
    model's again. (The unified worker of chunked over two ranks: tests/policies/test_policies_served.py.)"""
    with _tp_server("bullet", "--estimator-profile", fp32_srm_profile) as server:
        old = server.worker_pids()
        assert set(old) == {"prefill", "decode", "prefill.rank1", "decode.rank1"}, old
        _assert_served_as_unsplit(server, expected)
        assert wait_pages_accounted(server)["decode"]["batch_size"] == 0
        os.kill(old["decode.rank1"], signal.SIGKILL)
        wait_for(lambda: server.state()["incarnation"] > 1, 60, "a restart after the rank died")
        wait_for(lambda: server.get("/health")[0] == 200, 120, "the restarted ranks to serve")
        new = server.worker_pids()
        assert set(new) == set(old) and not set(new.values()) & set(old.values())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in old.values()):
            time.sleep(0.1)
        assert not [p for p in old.values() if pid_alive(p)], "a rank of the old incarnation outlived it"
        _assert_served_as_unsplit(server, expected, prompts=1)
