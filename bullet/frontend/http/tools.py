"""Function calling in chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

* The tools reach the model through the chat template (`tools=`); a template that ignores them is
  refused by name, since the model would then call functions it was never shown.
* `tool_choice` "required" or a named function: the reply is constrained (a JSON schema, through the
  same constrained decoding as `response_format`) to a call of the allowed functions, so it always
  parses. "auto": the model decides, and its text is read by the template's call format — `hermes`
  (`<tool_call>{"name", "arguments"}</tool_call>`, ChatML/Qwen templates) or `llama3` (a bare JSON
  object `{"name", "parameters"}`, several separated by ";"). "none": no tools in the prompt, a plain
  message back.
* A streamed reply sends text as it comes, holds back what may be the start of a call, and sends each
  call as one `tool_calls` delta when it is complete (OpenAI's clients join deltas either way).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from bullet.frontend.http.errors import APIError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_template_tool(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str            # "auto" | "required" | "none" | "named"
    named: str | None      # the function tool_choice names
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model is shown (every one; a named choice still shows the rest, as OpenAI does)."""
        return () if self.choice == "none" else self.tools

    def constraint_schema(self) -> dict:
        """The JSON schema of a reply that is nothing but calls of the allowed functions."""
        allowed = [t for t in self.tools if self.choice != "named" or t.name == self.named]
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"]} for t in allowed]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if not self.parallel:
            return one
        return {"type": "array", "items": one, "minItems": 1}


def parse_tool_request(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None:
    """The request's tool fields, checked; None when it offers no tools (and asks for none)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools: the request lists none", param="tool_choice")
        return None
    parsed, seen = [], set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"{where}: only tools of type 'function' are supported", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"{where}.function must be an object with a name", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", param="tools")
        if name in seen:
            raise APIError(f"{where}: the function name {name!r} is given twice", param="tools")
        seen.add(name)
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise APIError(f"{where}.function.parameters must be a JSON schema object", param="tools")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise APIError(f"{where}.function.description must be a string", param="tools")
        parsed.append(Tool(name, description, params))
    named = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required", "none"):
            raise APIError(f"tool_choice must be 'auto', 'required', 'none' or a named function; got "
                           f"{tool_choice[:40]!r}", param="tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        named = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(named, str):
            raise APIError("tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        if named not in seen:
            raise APIError(f"tool_choice names the function {named[:64]!r}, which is not among the tools",
                           param="tool_choice")
        choice = "named"
    else:
        raise APIError("tool_choice must be a string or an object", param="tool_choice")
    return ToolRequest(tuple(parsed), choice, named, True if parallel_tool_calls is None else parallel_tool_calls)


# -- reading calls out of the model's text --------------------------------------------------------

@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj, names: set[str], args_keys=("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _objects(text: str, sep: str | None) -> list | None:
    """JSON values in `text` (one, or several separated by `sep`), or None when it is not that."""
    decoder, pos, out = json.JSONDecoder(), 0, []
    text = text.strip()
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        out.append(value)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text):
            if sep is None or text[pos] != sep:
                return None
            pos += 1
            while pos < len(text) and text[pos].isspace():
                pos += 1
    return out or None


def parse_constrained(text: str, request: ToolRequest) -> list[Call] | None:
    """A constrained reply (`ToolRequest.constraint_schema`) as calls; None if it was cut short."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    names = {t.name for t in request.tools}
    calls = [_call(v, names) for v in values]
    return calls if calls and all(calls) else None


def parse_hermes(text: str, names: set[str]) -> tuple[str, list[Call]]:
    """(content, calls) of a reply with <tool_call> blocks; a block that does not parse stays text."""
    if HERMES_OPEN not in text:
        return text, []
    content, calls = [], []
    rest = text
    while HERMES_OPEN in rest:
        before, _, after = rest.partition(HERMES_OPEN)
        content.append(before)
        body, closed, rest = after.partition(HERMES_CLOSE)
        values = _objects(body, None)
        call = _call(values[0], names) if values and len(values) == 1 else None
        if call is None:
            content.append(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""))
        else:
            calls.append(call)
    content.append(rest)
    return "".join(content).strip() if calls else text, calls


def parse_llama3(text: str, names: set[str]) -> tuple[str, list[Call]]:
    """(content, calls) of a reply that is JSON calls only (optionally after <|python_tag|>), else text."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    if not body.lstrip().startswith("{"):
        return text, []
    values = _objects(body, ";")
    calls = [_call(v, names) for v in values] if values else []
    if not calls or not all(calls):
        return text, []
    return "", calls


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3}


def parser_for(setting: str, template: str | None) -> str:
    """The call format: the server's `--tool-call-parser`, or for auto the one the template teaches."""
    if setting != "auto":
        return setting
    text = template or ""
    if HERMES_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or "ipython" in text:
        return "llama3"
    return "hermes"


class CallReader:
    """One choice's reply, read as it streams: `feed` returns the text that can be shown now (never
    a part of a call), `finish` the text held back that turned out not to be a call, and the calls."""

    def __init__(self, request: ToolRequest, fmt: str):
        self.request, self.fmt = request, fmt
        self.names = {t.name for t in request.tools}
        self.text = ""    # everything so far
        self.shown = 0    # how much of it was returned as content

    def _safe_end(self) -> int:
        """How far the text can be shown without showing any part of a call."""
        if self.request.constrained:
            return 0  # the whole reply is a call
        if self.fmt == "llama3":
            head = self.text.lstrip()
            if not head:
                return 0
            if head.startswith("{") or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]):
                return 0  # may be a call: held back to the end
            return len(self.text)
        at = self.text.find(HERMES_OPEN)
        if at >= 0:
            return at
        # a suffix that may be the start of "<tool_call>" waits for the next piece
        for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
            if HERMES_OPEN.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)

    def feed(self, delta: str) -> str:
        self.text += delta
        end = max(self._safe_end(), self.shown)
        out, self.shown = self.text[self.shown:end], end
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(content not yet shown, calls) once the reply is complete."""
        content, calls = read_calls(self.text, self.request, self.fmt)
        if not calls:
            return self.text[self.shown:], []
        # what was shown is the text before the first call; the rest of the content comes now
        shown = self.text[:self.shown].strip()
        rest = content[len(shown):] if content.startswith(shown) else ""
        return rest, calls


def read_calls(text: str, request: ToolRequest, fmt: str) -> tuple[str, list[Call]]:
    """(content, calls) of a whole reply."""
    if request.constrained:
        calls = parse_constrained(text, request)
        return (text, []) if calls is None else ("", calls)
    if request.choice == "none":
        return text, []
    return PARSERS[fmt](text, {t.name for t in request.tools})


def template_messages(messages) -> list[dict]:
    """Chat messages as the template reads them: an assistant's earlier calls with their arguments as
    objects (templates print them as JSON), a tool's reply with the call id it answers."""
    out = []
    for k, m in enumerate(messages):
        entry = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(f"messages[{k}].tool_calls[{j}] must have a function with a name", param="messages")
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    raise APIError(f"messages[{k}].tool_calls[{j}].function.arguments is not valid JSON",
                                   param="messages") from None
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
            entry["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            entry["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            entry["name"] = m["name"]
        out.append(entry)
    return out
