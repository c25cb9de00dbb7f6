"""Bad requests get a 4xx with a JSON error in the client family's shape whose message names the
offending field — never a 5xx, a hang, or a silently "fixed" request.

What counts as absurd: a generation budget that cannot fit in the model's context after the prompt
(max_new_tokens 10**9) is rejected up front, like a prompt longer than the context; wrong JSON types
are rejected rather than coerced ("5" is not 5, "yes" is not true)."""

from __future__ import annotations

import pytest

from tests.server_utils import wait_pages_accounted

LONG = "hello " * 9000  # about 9000 tokens: over the 8192-token context
HI = {"text": "hi"}


def sp(**fields) -> dict:
    return {**HI, "sampling_params": fields}


def msg(content="hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


NATIVE = [  # (case id, body, expected status, a word the message must contain)
    ("malformed-json", b'{"text": "hi",', 400, "JSON"),
    ("empty-body", b"", 400, "JSON"),
    ("not-an-object", b'["hi"]', 400, "object"),
    ("missing-prompt", {"sampling_params": {"max_new_tokens": 1}}, 400, "text"),
    ("empty-text", {"text": ""}, 400, "text"),
    ("empty-batch", {"text": []}, 400, "text"),
    ("empty-input-ids", {"input_ids": []}, 400, "input_ids"),
    ("both-prompts", {"text": "hi", "input_ids": [1]}, 400, "input_ids"),
    ("text-wrong-type", {"text": 5}, 400, "text"),
    ("input-ids-out-of-vocab", {"input_ids": [10**9]}, 400, "input_ids"),
    ("input-ids-negative", {"input_ids": [-1, 2]}, 400, "input_ids"),
    ("prompt-over-context", {"text": LONG, "sampling_params": {"max_new_tokens": 1}}, 400, "text"),
    ("sampling-params-not-object", {**HI, "sampling_params": 3}, 400, "sampling_params"),
    ("temperature-negative", sp(temperature=-1), 400, "temperature"),
    ("temperature-string", sp(temperature="hot"), 400, "temperature"),
    ("temperature-nan", b'{"text": "hi", "sampling_params": {"temperature": NaN}}', 400, "temperature"),
    ("top-p-zero", sp(top_p=0), 400, "top_p"),
    ("top-p-above-one", sp(top_p=1.5), 400, "top_p"),
    ("top-k-minus-five", sp(top_k=-5), 400, "top_k"),
    ("min-p-negative", sp(min_p=-0.1), 400, "min_p"),
    ("max-new-tokens-negative", sp(max_new_tokens=-1), 400, "max_new_tokens"),
    ("max-new-tokens-absurd", sp(max_new_tokens=10**9), 400, "max_new_tokens"),
    ("max-new-tokens-past-context", {"text": "hello " * 8100, "sampling_params": {"max_new_tokens": 200}}, 400,
     "max_new_tokens"),
    ("max-new-tokens-string", sp(max_new_tokens="5"), 400, "max_new_tokens"),
    ("max-new-tokens-float", sp(max_new_tokens=2.5), 400, "max_new_tokens"),
    ("max-new-tokens-bool", sp(max_new_tokens=True), 400, "max_new_tokens"),
    ("min-over-max", sp(min_new_tokens=5, max_new_tokens=2), 400, "min_new_tokens"),
    ("penalty-out-of-range", sp(frequency_penalty=5), 400, "frequency_penalty"),
    ("repetition-penalty-tiny", sp(repetition_penalty=1e-38), 400, "repetition_penalty"),
    ("seed-negative", sp(seed=-3), 400, "seed"),
    ("stop-wrong-type", sp(stop=5), 400, "stop"),
    ("stop-empty-string", sp(stop=[""]), 400, "stop"),
    ("stop-token-out-of-vocab", sp(stop_token_ids=[10**8]), 400, "stop_token_ids"),
    ("unknown-sampling-field", sp(temprature=0.5), 400, "temprature"),
    ("n-above-max", sp(n=9), 400, "n"),
    ("n-zero", sp(n=0), 400, "n"),
    ("n-bool", sp(n=True), 400, "n"),
    ("n-differs-in-batch", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, 400, "n"),
    # constraints: xgrammar's own message, naming the field; at most one; the right type
    ("regex-invalid", sp(regex="(a"), 400, "sampling_params.regex: invalid regular expression"),
    ("json-schema-invalid", sp(json_schema='{"type": "foo"}'), 400, "sampling_params.json_schema"),
    ("json-schema-not-json", sp(json_schema="{nope"), 400, "json_schema"),
    ("ebnf-undefined-rule", sp(ebnf="root ::= other"), 400, "ebnf"),
    ("structural-tag-not-an-object", sp(structural_tag="[1]"), 400, "structural_tag"),
    ("regex-wrong-type", sp(regex=5), 400, "regex"),
    ("two-constraints", sp(regex="a", ebnf='root ::= "a"'), 400, "at most one"),
    ("logit-bias-out-of-vocab", sp(logit_bias={"99999999": 1.0}), 400, "logit_bias"),
    ("logit-bias-absurd", sp(logit_bias={"5": 1e9}), 400, "logit_bias"),
    # fields this server does not implement are refused by name unless at their defaults
    ("lora-path", {**HI, "lora_path": "my-adapter"}, 400, "lora_path"),
    ("custom-logit-processor", {**HI, "custom_logit_processor": "x"}, 400, "custom_logit_processor"),
    ("priority-set", {**HI, "priority": 3}, 400, "priority"),
    ("no-stop-trim", sp(no_stop_trim=True), 400, "no_stop_trim"),
    ("custom-params", sp(custom_params={"k": 1}), 400, "custom_params"),
    ("stream-interval", sp(stream_interval=4), 400, "stream_interval"),
    ("stream-wrong-type", {**HI, "stream": "yes"}, 400, "stream"),
    ("top-logprobs-absurd", {**HI, "return_logprob": True, "top_logprobs_num": 10**6}, 400, "top_logprobs_num"),
    ("per-item-list-too-short", {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, 400,
     "sampling_params"),
    # integers far outside any sane range are 400s at the edge (never reach a worker)
    ("max-new-tokens-2**63", sp(max_new_tokens=2**63), 400, "max_new_tokens"),
    ("top-k-2**63", sp(top_k=2**63), 400, "top_k"),
    ("min-new-tokens-2**63", sp(min_new_tokens=2**63), 400, "min_new_tokens"),
    ("seed-2**64", sp(seed=2**64), 400, "seed"),
    ("stop-token-2**63", sp(stop_token_ids=[2**63]), 400, "stop_token_ids"),
    ("temperature-10**400", sp(temperature=10**400), 400, "temperature"),
    ("n-2**63", sp(n=2**63), 400, "n"),
    ("input-ids-2**63", {"input_ids": [1, 2**63]}, 400, "input_ids"),
    ("logprob-start-len-2**63", {**HI, "return_logprob": True, "logprob_start_len": 2**63}, 400,
     "logprob_start_len"),
    ("top-logprobs-2**63-unused", {**HI, "top_logprobs_num": 2**63}, 400, "top_logprobs_num"),
    ("top-logprobs-2**63-in-list", {"text": ["a"], "return_logprob": True, "top_logprobs_num": [2**63]}, 400,
     "top_logprobs_num"),
    ("priority-2**63", {**HI, "priority": 2**63}, 400, "priority"),
    ("priority-string", {**HI, "priority": "high"}, 400, "priority"),
    ("duplicate-rid-in-batch", {"text": ["a", "b"], "rid": "same", "sampling_params": {"max_new_tokens": 1}}, 400,
     "same"),
]

OPENAI = [  # (case id, path, body, expected status, a word the message must contain)
    ("completion-malformed-json", "/v1/completions", b"{", 400, "JSON"),
    ("completion-missing-prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("completion-empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("completion-empty-token-list", "/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("completion-mixed-prompt", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completion-prompt-over-context", "/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("completion-max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completion-max-tokens-negative", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completion-max-tokens-absurd", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("completion-temperature-negative", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completion-top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completion-top-k-minus-five", "/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("completion-n-zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completion-logprobs-absurd", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("completion-stream-options-wrong-type", "/v1/completions", {"prompt": "hi", "stream_options": 5}, 400,
     "stream_options"),
    ("completion-max-tokens-2**63", "/v1/completions", {"prompt": "hi", "max_tokens": 2**63}, 400, "max_tokens"),
    ("completion-n-2**63", "/v1/completions", {"prompt": "hi", "n": 2**63}, 400, "n"),
    ("completion-logprobs-2**63", "/v1/completions", {"prompt": "hi", "logprobs": 2**63}, 400, "logprobs"),
    ("completion-top-k-2**63", "/v1/completions", {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),
    ("completion-seed-2**63", "/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("completion-min-tokens-2**63", "/v1/completions", {"prompt": "hi", "min_tokens": 2**63}, 400, "min_tokens"),
    ("completion-prompt-id-2**63", "/v1/completions", {"prompt": [1, 2**63]}, 400, "prompt"),
    ("completion-stop-token-2**63", "/v1/completions", {"prompt": "hi", "stop_token_ids": [2**63]}, 400,
     "stop_token_ids"),
    ("completion-priority-2**63", "/v1/completions", {"prompt": "hi", "priority": 2**63}, 400, "priority"),
    ("completion-unknown-model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "gpt-17"),
    ("chat-missing-messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("chat-empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat-messages-string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat-missing-role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("chat-content-wrong-type", "/v1/chat/completions", msg(content=5), 400, "content"),
    ("chat-image-content", "/v1/chat/completions", msg(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
     400, "image_url"),
    ("chat-prompt-over-context", "/v1/chat/completions", msg(content=LONG), 400, "messages"),
    ("chat-max-tokens-zero", "/v1/chat/completions", msg(max_tokens=0), 400, "max_tokens"),
    ("chat-max-completion-tokens-absurd", "/v1/chat/completions", msg(max_completion_tokens=10**9), 400,
     "max_completion_tokens"),
    ("chat-temperature-negative", "/v1/chat/completions", msg(temperature=-1), 400, "temperature"),
    ("chat-top-logprobs-absurd", "/v1/chat/completions", msg(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    ("chat-response-format-bad-schema", "/v1/chat/completions",
     msg(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}), 400,
     "response_format: invalid JSON schema"),
    ("chat-response-format-no-schema", "/v1/chat/completions",
     msg(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format"),
    ("chat-response-format-unknown-type", "/v1/chat/completions", msg(response_format={"type": "xml"}), 400,
     "response_format"),
    ("chat-regex-and-response-format", "/v1/chat/completions",
     msg(regex="a+", response_format={"type": "json_object"}), 400, "at most one"),
    ("completion-bad-regex", "/v1/completions", {"prompt": "hi", "regex": "[a-"}, 400, "regex"),
    ("completion-best-of-below-n", "/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("completion-lora-path", "/v1/completions", {"prompt": "hi", "lora_path": "a"}, 400, "lora_path"),
    ("completion-logit-bias-key", "/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("chat-max-tokens-2**63", "/v1/chat/completions", msg(max_tokens=2**63), 400, "max_tokens"),
    ("chat-top-logprobs-2**63", "/v1/chat/completions", msg(logprobs=True, top_logprobs=2**63), 400,
     "top_logprobs"),
    ("chat-n-2**63", "/v1/chat/completions", msg(n=2**63), 400, "n"),
    ("chat-unknown-model", "/v1/chat/completions", {**msg(), "model": "gpt-17"}, 404, "gpt-17"),
]


@pytest.mark.parametrize("body,status,word", [c[1:] for c in NATIVE], ids=[c[0] for c in NATIVE])
def test_native_bad_request(server, body, status, word):
    got, err = server.post("/generate", body)
    assert got == status, err
    assert isinstance(err, dict) and set(err) == {"error"}, err
    assert word in err["error"]["message"], err


@pytest.mark.parametrize("path,body,status,word", [c[1:] for c in OPENAI], ids=[c[0] for c in OPENAI])
def test_openai_bad_request(server, path, body, status, word):
    got, err = server.post(path, body)
    assert got == status, err
    assert isinstance(err, dict) and err["object"] == "error" and err["type"], err
    assert word in err["message"], err
    if status == 404:
        assert err["code"] == "model_not_found" and err["param"] == "model"


def test_tiny_temperature_means_greedy_and_harms_no_worker(server):
    """A temperature of 1e-38 used to overflow the logits to inf and kill the prefill worker on a NaN
    probability; it now means greedy (as in SGLang), and the workers survive."""
    pids = server.worker_pids()
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}
    greedy = server.post("/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 0}})
    tiny = server.post("/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 1e-38}})
    assert tiny[0] == 200 and tiny[1]["output_ids"] == greedy[1]["output_ids"]
    state = server.state()
    assert state["worker_pids"] == pids and state["worker_restarts"] == 0


def test_nothing_ran_for_rejected_requests(server):
    """Rejections happen before anything reaches the workers (or are undone): all pages are free."""
    state = wait_pages_accounted(server)
    assert state["inflight_requests"] == 0
    assert server.get("/health")[0] == 200
