"""--api-key: every endpoint but the health probes and /metrics wants `Authorization: Bearer <key>`;
without it (or with a wrong one) the answer is a 401 with a JSON error in the client family's
shape; with it everything works, including the real openai and SGLang clients."""

from __future__ import annotations

import pytest

from tests.frontend.helpers import API_KEY, AUTH, post_stream

GEN = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

WRONG = [{}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"},
         {"Authorization": f"Bearer {API_KEY}x"}]
WRONG_IDS = ["none", "wrong-key", "no-scheme", "basic-scheme", "key-prefix"]


@pytest.mark.parametrize("headers", WRONG, ids=WRONG_IDS)
def test_native_requests_without_the_key_are_401(secured, headers):
    for method, path, body in [("POST", "/generate", GEN), ("GET", "/model_info", None), ("GET", "/server_info", None),
                               ("POST", "/flush_cache", None)]:
        status, err = secured.request(method, path, body, headers)
        assert status == 401, (path, err)
        assert "API key" in err["error"]["message"]


@pytest.mark.parametrize("headers", WRONG, ids=WRONG_IDS)
def test_openai_requests_without_the_key_are_401(secured, headers):
    for method, path, body in [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None)]:
        status, err = secured.request(method, path, body, headers)
        assert status == 401, (path, err)
        assert err["object"] == "error" and "API key" in err["message"]


def test_requests_with_the_key_work(secured):
    assert secured.post("/generate", GEN, headers=AUTH)[0] == 200
    assert secured.get("/server_info", headers=AUTH)[0] == 200
    assert secured.get("/model_info", headers={"authorization": f"bearer {API_KEY}"})[0] == 200  # case-insensitive
    status, _, events = post_stream(secured.url, "/generate", {**GEN, "stream": True}, headers=AUTH)
    assert status == 200 and events[-1] == "[DONE]"
    status, out = secured.post("/v1/chat/completions", CHAT, headers=AUTH)
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


def test_health_and_metrics_stay_open(secured):
    assert secured.get("/health", headers={}) == (200, {"status": "ok"})
    assert secured.get("/health_generate", headers={})[0] == 200
    status, text = secured.get("/metrics", headers={})
    assert status == 200 and 'bullet:http_requests_total{path="unauthorized",status="401"}' in text


def test_real_clients_send_the_key(secured):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=secured.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        out = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=secured.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    sgl = pytest.importorskip("sglang")
    endpoint = sgl.RuntimeEndpoint(secured.url, api_key=API_KEY)
    assert endpoint.get_server_info()["internal_states"]
