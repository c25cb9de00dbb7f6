"""Tool calls through the real `openai` client, on the `secured` server (static policy: every reply's
first token from the prefill worker, the rest from the decode worker), started with
`--chat-template chatml-tools`: `tool_choice` "required" and a named function give calls whose
arguments follow the tool's schema, whole and streamed; "auto" reads the model's <tool_call> blocks
(the reply is steered into one with a regex, so the test does not depend on what a 135M model
chooses); an earlier call and its result go back through the template. On the default server, whose
template (SmolLM2's) shows no tools, tools are a 400 naming the template, and tool_choice "none"
answers as a plain chat."""

from __future__ import annotations

import json

import pytest

from tests.frontend.helpers import API_KEY

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                        "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def client(secured):
    with openai.OpenAI(base_url=secured.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("C", "F"), args
    return args


def test_required_and_named_choices_give_valid_calls(client):
    out = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        check_weather_args(call.function.arguments)
    named = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], **GREEDY,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and calls and all(
        c.function.name == "get_weather" for c in calls)
    for c in calls:
        check_weather_args(c.function.arguments)


def test_streamed_calls_join_into_the_whole_reply(client):
    kw = dict(model="default", messages=ASK, tools=[WEATHER], parallel_tool_calls=False, **GREEDY,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # no piece of the call leaks out as text
    parts = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert parts and {p.index for p in parts} == {0}
    assert "".join(p.function.name or "" for p in parts) == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == json.loads(whole.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


AUTO_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "unit": "C"\}\}\n</tool_call>'


def test_auto_reads_the_models_tool_call_blocks(client):
    kw = dict(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", **GREEDY,
              extra_body={"regex": "I will check\\. " + AUTO_CALL})
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "I will check.", out
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather" and check_weather_args(call.function.arguments)["unit"] == "C"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas).strip() == "I will check."
    assert json.loads("".join(tc.function.arguments or "" for d in deltas for tc in (d.tool_calls or []))) == \
        json.loads(call.function.arguments)
    # a reply without a call is a plain message
    plain = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], **GREEDY,
                                           extra_body={"regex": "It is sunny\\."}).choices[0]
    assert plain.message.content == "It is sunny." and not plain.message.tool_calls and plain.finish_reason == "stop"


def test_an_earlier_call_and_its_result_go_back_to_the_model(client, secured):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = client.chat.completions.create(model="default", messages=history, tools=[WEATHER], tool_choice="none",
                                         **GREEDY)
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    with_tools = client.chat.completions.create(model="default", messages=history, tools=[WEATHER], **GREEDY)
    assert with_tools.usage.prompt_tokens > out.usage.prompt_tokens  # "none" leaves the tools out of the prompt
    status, err = secured.post("/v1/chat/completions", {"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "get_weather", "arguments": "{city"}}]}], "tools": [WEATHER]})
    assert status == 400 and "arguments is not valid JSON" in err["message"], err


def test_bad_tool_requests_are_400s_and_the_server_stays_healthy(client, secured):
    for body, words in [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "not among the tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "leave response_format out"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {
            "a": {"type": "not-a-type"}}}}}], "tool_choice": "required"}, "tools"),
    ]:
        status, err = secured.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
        assert status == 400 and words in err["message"], (body, err)
    assert client.chat.completions.create(model="default", messages=ASK, max_tokens=2).choices[0].message.content


def test_a_template_without_tools_is_named(server):
    status, err = server.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
    assert status == 400 and err["param"] == "tools", err
    assert "does not show tools" in err["message"] and "--chat-template" in err["message"]
    status, out = server.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": "none",
                                                       "max_tokens": 4, "temperature": 0})
    assert status == 200 and out["choices"][0]["message"]["content"] and "tool_calls" not in out["choices"][0]["message"]
