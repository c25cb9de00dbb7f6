"""No request field is accepted and silently ignored: every field of SGLang's and OpenAI's request
bodies (read from the installed packages) is classified in bullet.frontend.http.fields; the refused
ones are a 400 naming them through the real server, the harmless ones are accepted; `best_of`
returns the samples with the highest cumulative log-probability; `priority` names the flag it needs."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

from bullet.frontend.http import fields
from bullet.frontend.http.fields import BODIES, Kind
from bullet.frontend.http.protocol import ChatBody, ChatMessage, CompletionBody, GenerateBody
from engines.sampling_params import SamplingParams
from tests.frontend.helpers import post_stream

ROOT = Path(__file__).resolve().parents[2]


# -- the field lists of the real clients and servers ------------------------------------------

def openai_chat() -> set[str]:
    mod = pytest.importorskip("openai.types.chat.completion_create_params", reason="the openai package is not installed")
    return set(mod.CompletionCreateParamsBase.__annotations__)


def openai_completion() -> set[str]:
    mod = pytest.importorskip("openai.types.completion_create_params", reason="the openai package is not installed")
    return set(mod.CompletionCreateParamsBase.__annotations__)


def _sglang_protocol():
    return pytest.importorskip("sglang.srt.entrypoints.openai.protocol",
                               reason="sglang (with its OpenAI protocol) is not installed")


def sglang_chat() -> set[str]:
    return set(_sglang_protocol().ChatCompletionRequest.model_fields)


def sglang_completion() -> set[str]:
    return set(_sglang_protocol().CompletionRequest.model_fields)


def openai_message() -> set[str]:
    """The fields of every role's message param."""
    mod = pytest.importorskip("openai.types.chat", reason="the openai package is not installed")
    params = [getattr(mod, f"ChatCompletion{role}MessageParam") for role in
              ("System", "Developer", "User", "Assistant", "Tool", "Function")]
    return set().union(*(p.__annotations__ for p in params))


def sglang_message() -> set[str]:
    mod = _sglang_protocol()
    return set(mod.ChatCompletionMessageGenericParam.model_fields) | set(mod.ChatCompletionMessageUserParam.model_fields)


def sglang_sampling() -> set[str]:
    mod = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="sglang is not installed")
    return set(inspect.signature(mod.SamplingParams.__init__).parameters) - {"self"}


def sglang_generate() -> set[str]:
    """GenerateReqInput's dataclass fields, read from its source: io_struct.py imports packages
    (partial_json_parser, ...) an install may lack, and the field names are all the test needs."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    source = Path(list(spec.submodule_search_locations)[0]) / "srt" / "managers" / "io_struct.py"
    if not source.is_file():
        pytest.skip(f"sglang has no {source}")
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "GenerateReqInput":
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    pytest.fail(f"no GenerateReqInput class in {source}")


LISTS = [("chat", openai_chat), ("chat", sglang_chat), ("message", openai_message), ("message", sglang_message),
         ("completion", openai_completion),
         ("completion", sglang_completion), ("sampling_params", sglang_sampling), ("generate", sglang_generate)]


@pytest.mark.parametrize("body,listing", LISTS, ids=[f"{b}-{f.__name__}" for b, f in LISTS])
def test_every_field_of_the_clients_is_classified(body, listing):
    names = listing()
    assert len(names) > 5, names  # the list was read, not an empty stand-in
    missing = sorted(names - set(BODIES[body]))
    assert not missing, (f"{listing.__name__} has fields bullet/frontend/http/fields.py does not classify for "
                         f"{body}: {missing} — honour, refuse or (if the API says it changes no output) accept each")


MODELS = {"generate": GenerateBody, "chat": ChatBody, "completion": CompletionBody, "message": ChatMessage}


@pytest.mark.parametrize("body", MODELS)
def test_the_registry_and_the_request_models_agree(body):
    """A field called honoured is one the body reads; a refused or harmless one is not read (it
    never reaches the request: refusal runs on the raw JSON)."""
    read = set(MODELS[body].model_fields)
    table = BODIES[body]
    honoured = {n for n, r in table.items() if r.kind is Kind.HONOURED}
    assert honoured - read == set(), f"called honoured but not read by {MODELS[body].__name__}"
    assert read - honoured == set(), f"read by {MODELS[body].__name__} but not classified as honoured"


def test_honoured_sampling_fields_are_sampling_params():
    honoured = {n for n, r in BODIES["sampling_params"].items() if r.kind is Kind.HONOURED}
    assert honoured - set(SamplingParams.model_fields) == {"n"}  # n: the number of samples, read by the endpoint


def test_every_refusal_says_why_and_accepts_what_unset_means():
    for body, table in BODIES.items():
        for name, rule in table.items():
            if rule.kind is not Kind.HONOURED:
                assert rule.why, (body, name)
            if rule.kind is Kind.REFUSED:
                assert None in rule.accepted, (body, name)  # SGLang's clients send null for unset fields


def test_the_readme_lists_are_the_registry():
    text = (ROOT / "README.md").read_text()
    begin = text.index("<!-- fields:begin")
    start, end = text.index("\n", begin) + 1, text.index("<!-- fields:end -->")
    assert text[start:end].strip() == fields.readme_lists().strip(), \
        "README's refused-field lists are stale: paste the output of python -m bullet.frontend.http.fields"


# -- through the server ------------------------------------------------------------------------

def asking(rule) -> object:
    """A value of the field's own type that asks for something."""
    accepted = rule.accepted
    for unset, value in ((False, True), (True, False), (1, 4), (0, 1), ("", "adapter-1"), (["text"], ["audio"]),
                         ([], ["x"])):
        if any(a == unset and type(a) is type(unset) for a in accepted):
            return value
    if any(isinstance(a, dict) for a in accepted):
        return {"k": 1}
    return "x"


PROMPT = "The capital of France is"
BASE = {"generate": ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        "completion": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})}
REFUSED = [(body, name) for body, table in BODIES.items() for name, r in table.items() if r.kind is Kind.REFUSED]


def request_with(body: str, name: str, value) -> tuple[str, dict]:
    if body == "sampling_params":
        path, base = BASE["generate"]
        return path, {**base, "sampling_params": {**base["sampling_params"], name: value}}
    if body == "message":
        path, base = BASE["chat"]
        return path, {**base, "messages": [{**base["messages"][0], name: value}]}
    path, base = BASE[body]
    return path, {**base, name: value}


def named(out, name: str) -> str:
    """The error's message if the error names `name` (OpenAI's shape: as its param; SGLang's, which
    has no param: the message starts with it, after sampling_params. for a sampling field), else ""."""
    if not isinstance(out, dict):
        return ""
    if "error" in out:  # SGLang's shape
        message = out["error"].get("message", "")
        return message if message.removeprefix("sampling_params.").startswith(f"{name}:") else ""
    if out.get("param") == "messages" and out.get("message", "").startswith(f"messages[0].{name}:"):
        return out["message"]  # a field of a chat message
    return out.get("message", "") if out.get("param") == name else ""


def test_every_refused_field_is_a_400_naming_it(server):
    """Each refused field, set to a value that asks for something, through the real server (one
    test: the ~50 requests are refused before any work, so the loop takes well under a second)."""
    wrong = []
    for body, name in REFUSED:
        path, req = request_with(body, name, asking(BODIES[body][name]))
        status, out = server.post(path, req)
        if not (status == 400 and "not supported" in named(out, name)):
            wrong.append((body, name, status, out))
    assert not wrong, wrong


def test_a_batch_field_is_refused_when_one_prompt_asks(server):
    status, out = server.post("/generate", {"text": [PROMPT, PROMPT], "lora_path": [None, "adapter-1"],
                                            "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and named(out, "lora_path"), out


def test_logprob_switches_inside_sampling_params_are_refused(server):
    """/generate's log-probability options are top-level fields; the same names inside
    sampling_params would be overruled by them, so they are refused rather than ignored."""
    status, out = server.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "logprobs": True}})
    assert status == 400 and "return_logprob" in named(out, "logprobs"), out


@pytest.mark.parametrize("body", ["generate", "chat", "completion"])
def test_unset_refused_fields_and_harmless_fields_are_accepted(server, body):
    """What SGLang's clients send for fields they do not use (null, false, ...) together with the
    fields that change nothing: one 200."""
    path, req = BASE[body]
    table = BODIES[body]
    extra = {n: r.accepted[-1] for n, r in table.items() if r.kind is Kind.REFUSED}
    extra.update({n: "x" for n, r in table.items() if r.kind is Kind.NO_OUTPUT_EFFECT})
    if body == "generate":
        extra["sampling_params"] = {**req["sampling_params"], **{
            n: r.accepted[-1] for n, r in BODIES["sampling_params"].items() if r.kind is Kind.REFUSED}}
    status, out = server.post(path, {**req, **extra})
    assert status == 200, out


def test_unset_refused_message_fields_are_accepted(server):
    message = {"role": "user", "content": "hi",
               **{n: r.accepted[-1] for n, r in BODIES["message"].items() if r.kind is Kind.REFUSED}}
    status, out = server.post("/v1/chat/completions", {"messages": [message], "max_tokens": 1})
    assert status == 200, out


def test_a_developer_message_is_a_system_message(server):
    """OpenAI's developer role (its newer name for system instructions) reaches the template as system:
    the same prompt, so the same greedy reply and prompt size."""
    def reply(role):
        status, out = server.post("/v1/chat/completions", {"messages": [
            {"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}],
            "max_tokens": 4, "temperature": 0})
        assert status == 200, out
        return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"]

    assert reply("developer") == reply("system")


@pytest.mark.parametrize("role", ["function", "robot"])
def test_a_role_no_template_knows_is_a_400_naming_it(server, role):
    status, out = server.post("/v1/chat/completions", {"messages": [{"role": role, "content": "hi"}], "max_tokens": 1})
    assert status == 400 and out["param"] == "messages" and out["message"].startswith("messages[0].role:"), out


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": PROMPT, "priority": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": 1}),
    ("/v1/completions", {"prompt": PROMPT, "priority": -2}),
])
def test_a_priority_names_the_flag_it_needs(server, path, body):
    status, out = server.post(path, body)
    assert status == 400 and "--enable-priority-scheduling" in named(out, "priority"), out


# -- best_of -----------------------------------------------------------------------------------

SAMPLED = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0, "seed": 11}


def cumulative(choice) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(server):
    """The same seeded samples drawn twice: all three with their log-probabilities, then best_of 3
    with n 2 — which must be the two with the highest sums, best first."""
    status, every = server.post("/v1/completions", {**SAMPLED, "n": 3, "logprobs": 0})
    assert status == 200, every
    ranked = sorted(every["choices"], key=cumulative, reverse=True)
    assert len({c["text"] for c in ranked}) > 1, ranked  # sampling, not copies of one: the choice matters
    status, best = server.post("/v1/completions", {**SAMPLED, "n": 2, "best_of": 3, "logprobs": 0})
    assert status == 200, best
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]], (best, ranked)
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [round(cumulative(c), 4) for c in best["choices"]] == [round(cumulative(c), 4) for c in ranked[:2]]
    # usage counts every sample drawn
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in every["choices"])


def test_best_of_without_logprobs_returns_none(server):
    status, out = server.post("/v1/completions", {**SAMPLED, "max_tokens": 2, "best_of": 2})
    assert status == 200 and len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None, out


@pytest.mark.parametrize("extra,word", [({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 99}, "best_of"),
                                        ({"best_of": 2, "stream": True}, "streamed")])
def test_impossible_best_of_is_a_400(server, extra, word):
    status, out = server.post("/v1/completions", {**SAMPLED, **extra})
    assert status == 400 and word in named(out, "best_of"), out


def test_best_of_equal_to_n_streams(server):
    status, _, events = post_stream(server.url, "/v1/completions", {**SAMPLED, "n": 2, "best_of": 2, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert {e["choices"][0]["index"] for e in events[:-1] if e["choices"]} == {0, 1}
