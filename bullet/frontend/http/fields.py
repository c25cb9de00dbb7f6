"""Every request field SGLang's and OpenAI's clients send, and what this server does with it — so
that no field is accepted and silently ignored. Each field of each body is one of:

* HONOURED: implemented (the endpoint reads it and the output follows it);
* REFUSED: not implemented; accepted only at a value that asks for nothing (`accepted`, the values a
  client sends for "unset"), any other value is a 400 that names the field and says why;
* NO_OUTPUT_EFFECT: by the API's own definition it changes nothing in the reply (bookkeeping for
  the provider: end-user ids, tags, billing tiers, cache hints), so it is accepted and not used.

Fields in none of these tables (a client's own junk) are still accepted and dropped, as before;
tests/frontend/test_request_fields.py walks the field lists of the installed `openai` and `sglang`
packages and fails on any field that is not classified here."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from bullet.frontend.http.errors import APIError


class Kind(enum.Enum):
    HONOURED = "honoured"
    REFUSED = "refused"
    NO_OUTPUT_EFFECT = "no output effect"


@dataclass(frozen=True)
class Rule:
    kind: Kind
    why: str = ""  # REFUSED: why it is refused (what the server does instead); NO_OUTPUT_EFFECT: why accepting it is harmless
    accepted: tuple = (None,)  # REFUSED: the values that ask for nothing (compared with their type)


def honoured(*names: str) -> dict[str, Rule]:
    return {name: Rule(Kind.HONOURED) for name in names}


def refused(why: str, *names: str, accepted: tuple = (None,)) -> dict[str, Rule]:
    return {name: Rule(Kind.REFUSED, why, accepted) for name in names}


def harmless(why: str, *names: str) -> dict[str, Rule]:
    return {name: Rule(Kind.NO_OUTPUT_EFFECT, why) for name in names}


_DISAGG = "prefill and decode run on one device here, not on disaggregated servers"
_LORA = "no LoRA adapters are served"
_HIDDEN = "hidden states are never returned"
_SESSION = "there are no sessions: send the whole prompt each time"
_NO_STOP_TRIM = "the output always ends before a matched stop string"

# SGLang's /generate body (GenerateReqInput)
GENERATE: dict[str, Rule] = {
    **honoured("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "return_text_in_logprobs", "stream", "priority"),
    **refused("a prompt is text or input_ids, not embeddings", "input_embeds"),
    **refused("the served models take text only", "image_data", "video_data", "audio_data", "modalities",
              accepted=(None, [])),
    **refused("log-probabilities of chosen token ids are not computed (top_logprobs_num gives the most likely ones)",
              "token_ids_logprob", accepted=(None, [])),
    **refused(_HIDDEN, "return_hidden_states", accepted=(None, False)),
    **refused(_SESSION, "session_params", accepted=(None, {})),
    **refused(_LORA, "lora_path", "lora_id", accepted=(None, "")),
    **refused("custom logit processors are never run", "custom_logit_processor",
              accepted=(None, "")),
    **refused(_DISAGG, "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key"),
    # one engine: rank 0 is the only one there is
    **refused("there is one data-parallel rank (0)", "data_parallel_rank", accepted=(None, 0)),
    **refused("the reply always comes on this connection", "background",
              accepted=(None, False)),
    **refused("only JSON replies are served", "return_bytes", accepted=(None, False)),
    # SGLang's own switch for its metrics log (its /health_generate turns it off); the reply is the same
    **harmless("only decides whether the server logs the request's metrics", "log_metrics"),
    **harmless("a name for tracing the request; SGLang does not use it to generate", "conversation_id", "label"),
}

# SGLang's sampling_params (SamplingParams), in /generate
SAMPLING: dict[str, Rule] = {
    **honoured("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
               "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "json_schema",
               "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "logit_bias", "seed"),
    **refused("only true, the default, is implemented", "spaces_between_special_tokens", accepted=(None, True)),
    **refused(_NO_STOP_TRIM, "no_stop_trim", accepted=(None, False)),
    **refused("custom logit processors are never run", "custom_params",
              accepted=(None, {})),
    **refused("every token is streamed as it comes", "stream_interval", accepted=(None, 1)),
}

# what both OpenAI bodies take, with SGLang's extensions
_OPENAI_COMMON: dict[str, Rule] = {
    **honoured("model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens", "n",
               "seed", "stop", "stream", "stream_options", "temperature", "top_p", "response_format",
               # SGLang's extensions
               "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "skip_special_tokens",
               "stop_token_ids", "regex", "ebnf", "json_schema", "rid", "priority"),
    **refused(_LORA, "lora_path", accepted=(None, "")),
    **refused(_NO_STOP_TRIM, "no_stop_trim", accepted=(None, False)),
    **refused(_HIDDEN, "return_hidden_states", accepted=(None, False)),
    **refused(_SESSION, "session_params", accepted=(None, {})),
    **refused(_DISAGG, "bootstrap_host", "bootstrap_port", "bootstrap_room"),
    # OpenAI: "a stable identifier for your end-users ... to help OpenAI detect abuse"
    **harmless("an end-user id for the provider's abuse monitoring", "user"),
}

CHAT: dict[str, Rule] = {
    **_OPENAI_COMMON,
    **honoured("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"),
    **refused("replies are text only", "audio"),
    **refused("replies are text only", "modalities", accepted=(None, ["text"])),
    **refused("the deprecated functions API: send tools and tool_choice", "functions",
              "function_call"),
    **refused("moderation is not run by this server", "moderation"),
    **refused("the model takes no reasoning effort or verbosity setting", "reasoning_effort", "verbosity"),
    **refused("there is no web search", "web_search_options"),
    **refused("the chat template takes no extra variables", "chat_template_kwargs", accepted=(None, {})),
    **refused("the reply always starts a new assistant message",
              "continue_final_message", accepted=(None, False)),
    # there is no reasoning parser: a reply's reasoning stays in its content (what false asks)
    **refused("there is no reasoning parser: reasoning stays in the content", "separate_reasoning",
              accepted=(None, False)),
    **refused("there is no reasoning parser: reasoning is streamed as content, as it comes", "stream_reasoning",
              accepted=(None, True)),
    # OpenAI: stored completions for its distillation/evals products, and tags to filter them by
    **harmless("stores the completion on the provider's side and tags it; the reply is the same", "store",
               "metadata"),
    # OpenAI: the processing tier (latency and price), not the model's output
    **harmless("the provider's processing tier (latency and price), not the reply", "service_tier"),
    # OpenAI: an id for its usage-policy enforcement, like `user`
    **harmless("an end-user id for the provider's abuse monitoring", "safety_identifier"),
    # OpenAI: prompt-cache routing and lifetime; this server's prefix cache is automatic
    **harmless("prompt-cache hints; the prefix cache here is automatic and never changes a reply",
               "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"),
    # OpenAI: Predicted Outputs make a reply faster where it matches the prediction, never different
    **harmless("a latency hint: the reply is the same with or without it", "prediction"),
}

COMPLETION: dict[str, Rule] = {
    **_OPENAI_COMMON,
    **honoured("prompt", "best_of", "echo"),
    **refused("there is no fill-in-the-middle (text after the completion)", "suffix", accepted=(None, "")),
}

# one chat message (`messages[i]`), any role: OpenAI's message params and SGLang's
MESSAGE: dict[str, Rule] = {
    **honoured("role", "content", "name", "tool_calls", "tool_call_id"),
    **refused("an earlier reply's audio cannot be shown to a text model", "audio"),
    **refused("the deprecated functions API: send the call in tool_calls", "function_call"),
    **refused("the chat template does not show an earlier refusal: put its text in content", "refusal"),
    **refused("there is no reasoning parser, and the chat template does not show reasoning: put it in content",
              "reasoning_content"),
}

BODIES: dict[str, dict[str, Rule]] = {"generate": GENERATE, "sampling_params": SAMPLING, "chat": CHAT,
                                      "completion": COMPLETION, "message": MESSAGE}


def asks_for_nothing(value: Any, rule: Rule, per_item: bool = False) -> bool:
    """Whether `value` is one of the rule's accepted values (type and all: 0 is not false) — or,
    with `per_item` (SGLang's batch bodies give a field per prompt), a list of such values."""
    if any(value == a and type(value) is type(a) for a in rule.accepted):
        return True
    return per_item and isinstance(value, list) and all(asks_for_nothing(v, rule) for v in value)


def refuse(data: dict, body: str, where: str = "", param: str | None = None) -> None:
    """400 naming the first REFUSED field of `data` that asks for something (`param`: the error's
    param, by default the field)."""
    per_item = body == "generate"
    for name, rule in BODIES[body].items():
        if rule.kind is Kind.REFUSED and name in data and not asks_for_nothing(data[name], rule, per_item):
            unset = " or ".join(map(_json, rule.accepted))
            raise APIError(f"{where}{name}: not supported by this server; {rule.why} (leave it out, or send {unset})",
                           param=param or name)


def names(body: str, kind: Kind) -> list[str]:
    return sorted(n for n, r in BODIES[body].items() if r.kind is kind)


ENDPOINTS = {"generate": "`/generate`", "sampling_params": "`/generate`'s `sampling_params`",
             "chat": "`/v1/chat/completions`", "message": "`/v1/chat/completions`' `messages[i]`",
             "completion": "`/v1/completions`"}


def _json(value: Any) -> str:
    return "null" if value is None else json.dumps(value)


def readme_lists() -> str:
    """The README's lists of refused and harmless fields, rendered from the tables above (the
    README holds this text between its `fields:begin` / `fields:end` markers; a test compares)."""
    lines = []
    for body, endpoint in ENDPOINTS.items():
        table = BODIES[body]
        items = [f"`{n}` ({' or '.join(map(_json, table[n].accepted))})" for n in names(body, Kind.REFUSED)]
        lines.append(f"- {endpoint}: " + ", ".join(items))
    harmless_names = sorted({n for table in BODIES.values() for n, r in table.items() if r.kind is Kind.NO_OUTPUT_EFFECT})
    lines.append("")
    lines.append("Accepted and not used, since by their API's own definition they change nothing in the reply: "
                 + ", ".join(f"`{n}`" for n in harmless_names) + ".")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m bullet.frontend.http.fields: the README's lists
    print(readme_lists())
