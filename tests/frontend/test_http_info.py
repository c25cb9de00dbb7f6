"""The read-only endpoints clients probe: /model_info, /server_info (both spellings), /health,
/health_generate, /flush_cache, /v1/models, /metrics, and JSON errors for unknown paths."""

from __future__ import annotations

import os

import pytest

from tests.frontend.helpers import metric, token_counters, wait_idle


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info(server, path):
    status, info = server.get(path)
    assert status == 200
    assert {"model_path", "tokenizer_path", "is_generation", "served_model_name"} <= set(info)
    assert info["is_generation"] is True
    assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))  # a directory clients can load
    # SGLang's frontend picks its chat template by regex on model_path
    assert "smollm2" in info["model_path"].lower()


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info(server, path):
    status, info = server.get(path)
    assert status == 200 and info["version"]
    states = info["internal_states"]
    assert isinstance(states, list) and states and all(isinstance(s, dict) for s in states)
    s = states[0]
    assert s["kv_pages_total"] > 0 and 0 <= s["kv_pages_free"] <= s["kv_pages_total"]
    assert set(s["worker_pids"]) == {"prefill", "decode"}
    for role in ("prefill", "decode"):  # an idle worker may hold no units
        assert 0 <= s[role]["compute_units"] <= os.cpu_count()
        assert "batch_size" in s[role] and "queued_requests" in s[role]
    assert "api_key" not in info  # a secret never leaves the server


def test_health(server):
    assert server.get("/health") == (200, {"status": "ok"})


def test_health_generate_runs_a_real_generation(server):
    before = token_counters(server)
    status, body = server.get("/health_generate")
    assert status == 200 and body["status"] == "ok"
    after = token_counters(server)
    assert after[1] == before[1] + 1  # exactly one generated token


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_flush_cache(server, method):
    status, body = server.request(method, "/flush_cache?timeout=5", b"" if method == "POST" else None)
    assert status == 200 and "flushed" in body["message"].lower()


def test_v1_models(server):
    status, body = server.get("/v1/models")
    assert status == 200 and body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(model)
    assert model["object"] == "model" and model["max_model_len"] == 8192
    assert model["id"] == server.get("/model_info")[1]["served_model_name"]


def test_metrics_exposes_latency_histograms_queues_and_compute_units(server):
    """Both prefixes: SGLang's names for what both servers have (so its dashboards work), ours for
    the compute shares and the policy's decisions and repartitions."""
    server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    wait_idle(server)  # the gauges read below must agree with /server_info's snapshot
    status, text = server.get("/metrics")
    assert status == 200 and isinstance(text, str)
    model = {"model_name": server.get("/model_info")[1]["served_model_name"]}
    for hist, labels in (("sglang:time_to_first_token_seconds", model), ("sglang:inter_token_latency_seconds", model),
                         ("sglang:e2e_request_latency_seconds", model), ("bullet:time_per_output_token_seconds", {})):
        assert f"# TYPE {hist} histogram" in text
        assert metric(text, f"{hist}_count", labels) >= 1
        assert metric(text, f"{hist}_bucket", {**labels, "le": "+Inf"}) == metric(text, f"{hist}_count", labels)
    for counter in ("sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total"):
        assert f"# TYPE {counter} counter" in text and metric(text, counter, model) >= 1
    assert 0 <= metric(text, "sglang:cache_hit_rate", model) <= 1
    state = server.state()
    used = state["kv_pages_total"] - state["kv_pages_free"] - state["kv_pages_evictable"]  # cached pages are free to use
    assert metric(text, "sglang:token_usage", model) == pytest.approx(used / state["kv_pages_total"])
    for role in ("prefill", "decode"):
        worker = {**model, "engine_type": role}
        assert f'sglang:num_running_reqs{{engine_type="{role}",model_name="{model["model_name"]}"}}' in text
        assert metric(text, "sglang:num_queue_reqs", worker) == state[role]["queued_requests"]
        assert metric(text, "bullet:compute_units", {"worker": role}) == state[role]["compute_units"]
        # every step follows a decision (the counts themselves: tests/loops/test_published_counters.py)
        assert metric(text, "bullet:decisions_total", {"worker": role}) >= metric(text, "bullet:steps_total",
                                                                                  {"worker": role}) >= 1
        assert f'bullet:repartitions_total{{worker="{role}"}}' in text
    assert metric(text, "bullet:kv_pages_total") == state["kv_pages_total"]
    assert metric(text, "bullet:up") == 1
    assert metric(text, "bullet:http_requests_total", {"path": "/generate", "status": "200"}) >= 1


@pytest.mark.parametrize("path,shape", [("/no/such/path", "native"), ("/v1/no/such/path", "openai")])
def test_unknown_path_is_a_json_404(server, path, shape):
    status, body = server.post(path, {})
    assert status == 404
    message = body["error"]["message"] if shape == "native" else body["message"]
    assert path in message


def test_wrong_method_is_a_json_405(server):
    status, body = server.post("/health", {})
    assert status == 405 and "/health" in body["error"]["message"]
