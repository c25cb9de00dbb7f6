"""Where an SGLang user would notice a difference (issue 16): /generate with n > 1 (also through the
real frontend's fork and the openai client's n), real input_top_logprobs, /abort_request by rid,
`priority` accepted at its default (null or 0) and refused otherwise without
--enable-priority-scheduling, and process titles that name each process's role."""

from __future__ import annotations

import json
import math
import threading
import urllib.request

import pytest

from tests.frontend.helpers import open_raw_request, read_events, sse_events, wait_idle

PROMPT = "The capital of France is"


def gen(**fields) -> dict:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, **fields}}


# -- n > 1 ---------------------------------------------------------------------------------------

def test_n_samples_of_one_prompt_come_back_as_a_list(server):
    status, out = server.post("/generate", gen(n=3, temperature=1.0, seed=11))
    assert status == 200 and isinstance(out, list) and len(out) == 3, out
    assert all(o["meta_info"]["completion_tokens"] == 6 and o["meta_info"]["prompt_tokens"] == 5 for o in out)
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # n samples, not n copies of one
    again = server.post("/generate", gen(n=3, temperature=1.0, seed=11))[1]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]  # seeded: reproducible
    wait_idle(server)


def test_n_greedy_samples_agree(server):
    status, out = server.post("/generate", gen(n=2, temperature=0))
    assert status == 200 and out[0]["output_ids"] == out[1]["output_ids"]


def test_batch_with_n_is_prompt_major(server):
    """SGLang's order: every sample of prompt 0, then every sample of prompt 1."""
    body = {"text": ["Hi", "One two three four five six"], "sampling_params": {"max_new_tokens": 2, "n": 2}}
    status, out = server.post("/generate", body)
    assert status == 200 and len(out) == 4
    short, long_ = out[0]["meta_info"]["prompt_tokens"], out[2]["meta_info"]["prompt_tokens"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [short, short, long_, long_] and short < long_


def test_n_streams_with_an_index_per_sample(server):
    from tests.frontend.helpers import post_stream

    status, _, events = post_stream(server.url, "/generate", {**gen(n=2), "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    finals = {}
    for e in events[:-1]:
        finals[e["index"]] = e
    assert sorted(finals) == [0, 1]
    assert all(e["meta_info"]["finish_reason"] == {"type": "length", "length": 6} for e in finals.values())


def test_n_samples_carry_the_clients_rid_with_their_index(server):
    status, out = server.post("/generate", {**gen(n=2), "rid": "mine"})
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["mine-0", "mine-1"]


def test_openai_client_n_choices_differ_with_a_seed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say a word."}],
                                           n=3, max_tokens=8, temperature=1.0, seed=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens >= 3


def test_sglang_frontend_fork(server):
    """The real SGLang 0.5.2 frontend's fork: one prefix, several branches run in parallel."""
    sgl = pytest.importorskip("sglang")

    @sgl.function
    def branches(s):
        s += "List a fruit:"
        forks = s.fork(3)
        for f in forks:
            f += sgl.gen("item", max_tokens=6, temperature=0.9, stop="\n")
        # joined by the stop string: a sampled item may hold any other character, never that one
        s += "Fruits:" + "\n".join(f["item"] for f in forks)

    backend = sgl.RuntimeEndpoint(server.url)
    state = branches.run(backend=backend)
    assert state.text().startswith("List a fruit:")
    assert len(state.text().split("Fruits:", 1)[1].split("\n")) == 3  # all three branches answered


# -- input_top_logprobs --------------------------------------------------------------------------

def logprob_body(start: int, top: int = 3) -> dict:
    return {"text": PROMPT, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def test_input_top_logprobs_are_real(server):
    status, out = server.post("/generate", logprob_body(0))
    assert status == 200, out
    meta = out["meta_info"]
    inputs, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(tops) == len(inputs) == meta["prompt_tokens"]
    assert tops[0] is None  # nothing predicts the first token
    for (lp, token, _), top in zip(inputs[1:], tops[1:]):
        assert len(top) == 3
        values = [v for v, _, _ in top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert lp <= values[0] + 1e-5  # the prompt's own token is at most as likely as the best one
        for v, t, text in top:  # each entry is [logprob, token id, text], like SGLang's
            assert isinstance(t, int) and isinstance(text, str)
            if t == token:
                assert math.isclose(v, lp, rel_tol=1e-4, abs_tol=1e-5)
    # the greedy output token is the top-1 of the output distribution, and its logprob matches
    first = meta["output_top_logprobs"][0][0]
    assert first[1] == out["output_ids"][0]
    assert math.isclose(first[0], meta["output_token_logprobs"][0][0], rel_tol=1e-4, abs_tol=1e-5)


def test_input_top_logprobs_follow_logprob_start_len(server):
    full = server.post("/generate", logprob_body(0))[1]["meta_info"]
    part = server.post("/generate", logprob_body(2))[1]["meta_info"]
    assert len(part["input_top_logprobs"]) == len(part["input_token_logprobs"]) == part["prompt_tokens"] - 2
    for a, b in zip(full["input_top_logprobs"][2:], part["input_top_logprobs"]):
        assert [t for _, t, _ in a] == [t for _, t, _ in b]
    none = server.post("/generate", logprob_body(-1))[1]["meta_info"]
    assert none["input_top_logprobs"] == [] and none["input_token_logprobs"] == []


# -- /abort_request ------------------------------------------------------------------------------

LONG = {"text": "Count: 1, 2, 3,", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}


def test_abort_request_ends_a_stream_with_an_abort_finish(server):
    """The stream's last event is a normal one whose finish_reason is an abort (not a server error
    event), then [DONE]; the pages come back."""
    req = urllib.request.Request(server.url + "/generate", method="POST",
                                 data=json.dumps({**LONG, "stream": True, "rid": "to-abort"}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        head = resp.readline() + resp.readline()  # the first event and its blank line
        assert server.post("/abort_request", {"rid": "to-abort"}) == (200, {"aborted": ["to-abort"]})
        events = sse_events((head + resp.read()).decode())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert "error" not in last, last
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400
    wait_idle(server)


def test_abort_request_answers_a_waiting_call_with_its_partial_output(server):
    result = {}
    caller = threading.Thread(target=lambda: result.update(r=server.post("/generate", {**LONG, "rid": "waiting"})))
    caller.start()
    try:
        for _ in range(200):  # until the request is in flight
            if server.state()["inflight_requests"]:
                break
            threading.Event().wait(0.05)
        assert server.post("/abort_request", {"rid": "waiting"})[0] == 200
    finally:
        caller.join(60)
    status, out = result["r"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out
    assert out["meta_info"]["id"] == "waiting"
    wait_idle(server)


def test_abort_request_by_rid_takes_every_sample(server):
    sock = open_raw_request(server, "/generate", {**LONG, "stream": True, "rid": "family",
                                                  "sampling_params": {**LONG["sampling_params"], "n": 2}})
    try:
        read_events(sock, 2)
        status, out = server.post("/abort_request", {"rid": "family"})
        assert status == 200 and sorted(out["aborted"]) == ["family-0", "family-1"]
    finally:
        sock.close()
    wait_idle(server)


def test_abort_all(server):
    socks = [open_raw_request(server, "/generate", {**LONG, "stream": True}) for _ in range(2)]
    try:
        for s in socks:
            read_events(s, 1)
        status, out = server.post("/abort_request", {"abort_all": True})
        assert status == 200 and len(out["aborted"]) == 2
    finally:
        for s in socks:
            s.close()
    wait_idle(server)


def test_abort_request_unknown_rid_and_bad_bodies(server):
    assert server.post("/abort_request", {"rid": "no-such-request"}) == (200, {"aborted": []})
    for body, word in (({}, "rid"), ({"rid": 5}, "rid"), ({"abort_all": "yes"}, "abort_all")):
        status, err = server.post("/abort_request", body)
        assert status == 400 and word in err["error"]["message"], err


# -- priority ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/generate", {**gen(), "priority": None}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 0}),
])
def test_default_priority_is_accepted(server, path, body):
    status, out = server.post(path, body)
    assert status == 200, out


@pytest.mark.parametrize("path,body", [
    ("/generate", {**gen(), "priority": 3}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": -1}),
])
def test_a_priority_is_refused_by_name(server, path, body):
    """Without --enable-priority-scheduling a request that asks for an order is told so, not ignored."""
    status, out = server.post(path, body)
    assert status == 400 and "priority" in str(out), out


# -- process titles ------------------------------------------------------------------------------

def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def test_process_titles_name_the_roles(server):
    """`ps` shows what each process is, as SGLang names its processes."""
    assert cmdline(server.proc.pid).startswith(f"bullet::launcher port={server.port}")
    for role, pid in server.worker_pids().items():
        assert cmdline(pid).startswith(f"bullet::{role} port={server.port}"), cmdline(pid)
