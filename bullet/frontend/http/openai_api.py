"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from bullet.frontend.http.errors import APIError, stream_error_event
from bullet.frontend.http.generation import (
    ClientGone,
    Update,
    check_batch_size,
    check_fits,
    check_text_options,
    require_tokenizer,
    run_all,
    submit_all,
)
from bullet.frontend.http.offload import sized
from bullet.frontend.http.openai_logprobs import LogprobCursor, skipped_ids, token_bytes_ready
from bullet.frontend.http.protocol import ChatBody, CompletionBody, OpenAISampling, read_body
from bullet.frontend.http.sampling import MAX_N, build_sampling_params, check_constraint, per_sample
from bullet.frontend.http.streaming import EventStream, merged_updates, sse
from bullet.frontend.http.tools import CallReader, parse_tool_request, parser_for, read_calls, template_messages

router = APIRouter(prefix="/v1")
CREATED = int(time.time())


@router.get("/models")
async def models(request: Request):
    shared = request.app.state.runtime.model
    return {"object": "list", "data": [{"id": shared.model_name, "object": "model", "created": CREATED,
                                        "owned_by": "bullet", "root": shared.model_name,
                                        "max_model_len": shared.config.max_position_embeddings}]}


def _check_model(rt, body: OpenAISampling) -> str:
    name = rt.model.model_name
    if body.model not in (None, "", name, "default", rt.args.model_path):
        raise APIError(f"the model '{body.model}' does not exist; this server serves '{name}'", status=404,
                       type_="invalid_request_error", param="model", code="model_not_found")
    return name


ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (what SGLang compiles for it)


def response_format_constraint(rf: dict | None) -> dict:
    """OpenAI's response_format as a sampling constraint: text (none), json_object (any JSON object),
    json_schema (its schema; `strict` may be true or false: the output follows the schema exactly
    either way, which is what strict asks and more than non-strict promises), or a structural tag."""
    if not rf:
        return {}
    kind = rf.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return {"json_schema": ANY_OBJECT}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if spec is None and "schema" in rf:  # SGLang also takes the schema beside the type
            spec = {"schema": rf["schema"]}
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object with the schema under 'schema'",
                           param="response_format")
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, (dict, bool)):
            raise APIError("response_format.json_schema.schema is required (a JSON schema object)",
                           param="response_format")
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise APIError("response_format.json_schema.strict must be a boolean", param="response_format")
        if "name" in spec and not isinstance(spec["name"], str):
            raise APIError("response_format.json_schema.name must be a string", param="response_format")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(rf)}
    raise APIError(f"response_format.type must be one of text, json_object, json_schema, structural_tag; got "
                   f"{str(kind)[:50]!r}", param="response_format")


def _constraint_fields(body: OpenAISampling) -> tuple[dict, str | None]:
    """The request's constraint as sampling fields, and the field it came from (for its errors)."""
    given = {k: v for k, v in (("regex", body.regex), ("ebnf", body.ebnf), ("json_schema", body.json_schema))
             if v not in (None, "")}
    from_format = response_format_constraint(body.response_format)
    if from_format:
        given = {**given, "response_format": None}
    if len(given) > 1:
        raise APIError(f"give at most one constraint; got {', '.join(sorted(given))}", param=sorted(given)[-1])
    if from_format:
        return from_format, "response_format"
    return given, next(iter(given), None)


def _params(body: OpenAISampling, max_tokens: int | None, default_max: int, **extra):
    constraint, _ = _constraint_fields(body)
    if not 1 <= body.n <= MAX_N:
        raise APIError(f"n must lie in 1..{MAX_N}", param="n")
    fields = {"max_new_tokens": default_max if max_tokens is None else max_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p, "stop": body.stop,
              "stop_token_ids": body.stop_token_ids, "seed": body.seed, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
              "ignore_eos": body.ignore_eos, "min_new_tokens": body.min_tokens,
              "skip_special_tokens": body.skip_special_tokens, "logit_bias": body.logit_bias, **constraint, **extra}
    return build_sampling_params({k: v for k, v in fields.items() if v is not None}, where="request")


async def _check_constraint(rt, body: OpenAISampling, params) -> None:
    await check_constraint(rt, params, where="request", field=_constraint_fields(body)[1])


def _finish_reason(reason: dict | None) -> str | None:
    return None if reason is None else reason.get("type")


def _usage(states) -> dict:
    prompt = sum(len(s.prompt_ids) for s in states)
    completion = sum(len(s.output_ids) for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in states)}}


async def _submit_all(rt, jobs, rid: str | None, priority: int | None = None) -> list:
    """Submit every (prompt ids, params) job; with a client rid and several jobs, job k is
    `<rid>-<k>` and /abort_request with the rid aborts them all."""
    if rid is None or len(jobs) == 1:
        return await submit_all(rt, [(ids, params, rid, None, priority) for ids, params in jobs])
    return await submit_all(rt, [(ids, params, f"{rid}-{k}", rid, priority) for k, (ids, params) in enumerate(jobs)])


async def _finals(request: Request, rt, states) -> list[Update]:
    try:
        finals = await run_all(request, rt, states)
    except ClientGone:
        raise APIError("client disconnected", status=499)
    for u in finals:
        reason = u.state.finish_json or {}
        if reason.get("type") == "abort" and not u.state.cancelled:
            raise APIError(reason.get("message", "request failed"), status=503, type_="server_error")
    return finals


# -- completions ---------------------------------------------------------------------------------

def _best_of(body: CompletionBody) -> int:
    """Samples drawn per prompt: best_of (default n), of which the n best are returned."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if not body.n <= body.best_of <= MAX_N:
        raise APIError(f"best_of ({body.best_of}) must lie in n ({body.n})..{MAX_N}", param="best_of")
    if body.stream:
        raise APIError("best_of greater than n cannot be streamed (the best samples are known only when all have "
                       "finished); send stream false, or best_of equal to n", param="best_of")
    return body.best_of


def cumulative_logprob(state) -> float:
    """The sum of the log-probabilities of a sample's tokens (under the model's distribution)."""
    return sum(lp for lp in state.output_logprobs if lp is not None)


def _best(finals: list[Update], start: int, drawn: int, n: int) -> list[int]:
    """Indices of the n samples of finals[start:start + drawn] with the highest cumulative
    log-probability, best first (all of them, in order, when none is left out)."""
    group = range(start, start + drawn)
    if drawn == n:
        return list(group)
    return sorted(group, key=lambda k: -cumulative_logprob(finals[k].state))[:n]


@router.post("/completions")
async def completions(request: Request):
    rt = request.app.state.runtime
    body: CompletionBody = await read_body(request, CompletionBody)
    model = _check_model(rt, body)
    p = body.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts or any(len(x) == 0 for x in prompts):
        raise APIError("prompt is empty", param="prompt")
    best_of = _best_of(body)
    check_batch_size(rt, len(prompts) * best_of, "prompt")
    if body.max_tokens is not None and body.max_tokens < (0 if body.echo else 1):
        raise APIError("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
    want_lp = body.logprobs is not None
    choosing = best_of > body.n  # samples are ranked by the log-probabilities of their tokens
    # with echo the prompt's tokens are part of the answer, log-probabilities included
    params = _params(body, body.max_tokens, 16, logprobs=want_lp or choosing, top_logprobs_num=body.logprobs or 0,
                     prompt_logprobs=bool(want_lp and body.echo))
    await _check_constraint(rt, body, params)
    if rt.tokenizer is None:  # dummy weights: token ids in, token counts out, no text
        if any(isinstance(x, str) for x in prompts):
            require_tokenizer(rt, "send the prompt as token ids (a list of integers)", "prompt")
        if body.echo:
            require_tokenizer(rt, "echo returns the prompt as text; leave it false", "echo")
        if want_lp:
            require_tokenizer(rt, "logprobs name their tokens as text; leave logprobs unset", "logprobs")
        check_text_options(rt, params)
    # a multi-megabyte prompt takes seconds to tokenize (and to echo back): not on the event loop
    size = sum(len(x) for x in prompts)
    encoded = await sized(size, lambda: [rt.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in prompts])
    for ids in encoded:
        await sized(len(ids), check_fits, rt, ids, params, prompt_field="prompt", max_field="max_tokens")
    jobs = [(ids, sample) for ids in encoded for sample in per_sample(params, best_of)]
    if want_lp:  # before anything is submitted: nothing runs while the handler waits
        await token_bytes_ready(rt.tokenizer)
    states = await _submit_all(rt, jobs, body.rid, body.priority)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    # the prompt as text: echoed, and where log-probabilities' text_offset starts without echo
    prompt_text = (await sized(size, lambda: [x if isinstance(x, str) else rt.tokenizer.decode(ids)
                                              for x, ids in zip(prompts, encoded)])
                   if body.echo or want_lp else [""] * len(prompts))
    echo_text = [prompt_text[k // best_of] if body.echo else "" for k in range(len(jobs))]
    skipped = skipped_ids(rt.tokenizer, params.skip_special_tokens) if want_lp else set()
    # text_offset counts characters from the prompt's start, as OpenAI's does, echoed or not: with
    # echo the prompt's tokens come first, without it the first output token sits at the prompt's end
    starts = [0 if body.echo else len(prompt_text[k // best_of]) for k in range(len(jobs))]
    cursors = [LogprobCursor(rt.tokenizer, body.logprobs or 0, skipped, starts[k]) if want_lp else None
               for k in range(len(jobs))]

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            sent_echo = set()
            async with aclosing(merged_updates(rt, states)) as updates:
                async for i, u in updates:
                    reason = u.state.finish_json or {}
                    if reason.get("type") == "abort" and not u.state.cancelled:
                        yield sse(stream_error_event(reason.get("message", "request failed"), 503))
                        continue
                    text = u.delta
                    if body.echo and i not in sent_echo:
                        text, _ = echo_text[i] + text, sent_echo.add(i)
                    if not text and not u.done:
                        continue
                    lp = None
                    if want_lp:  # the prompt's entries (a thread's work when long) come with the first chunk only
                        size = len(u.state.prompt_ids) if body.echo and not cursors[i].prompt_done else 0
                        lp = await sized(size, cursors[i].completion, u.state, with_prompt=body.echo)
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": i, "text": text, "logprobs": lp,
                                            "finish_reason": _finish_reason(u.state.finish_json)}]})
            if include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": _usage(states)})

        return EventStream(events(), rt, states)

    finals = await _finals(request, rt, states)
    kept = [k for p in range(len(prompts)) for k in _best(finals, p * best_of, best_of, body.n)]
    choices = []
    for i, k in enumerate(kept):
        u = finals[k]
        lp = (await sized(len(u.state.prompt_ids) if body.echo else 0, cursors[k].completion, u.state,
                          with_prompt=body.echo) if want_lp else None)
        choices.append({"index": i, "text": echo_text[k] + u.text, "logprobs": lp,
                        "finish_reason": _finish_reason(u.state.finish_json)})
    # usage counts every sample drawn (best_of of them per prompt): all of them were computed
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": _usage([u.state for u in finals])})


# -- chat ----------------------------------------------------------------------------------------

def _message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(f"messages: content parts of type {part.get('type')!r} are not supported (text only)",
                           param="messages")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise APIError("messages: a text content part's 'text' must be a string", param="messages")
        parts.append(text)
    return "".join(parts)


def _chat_finish_reason(reason: dict | None, calls: list) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended in calls; a reply cut at max_tokens stays "length"."""
    kind = _finish_reason(reason)
    return "tool_calls" if calls and kind == "stop" else kind


@router.post("/chat/completions")
async def chat_completions(request: Request):
    rt = request.app.state.runtime
    body: ChatBody = await read_body(request, ChatBody)
    model = _check_model(rt, body)
    if not body.messages:
        raise APIError("messages must not be empty", param="messages")
    require_tokenizer(rt, "chat messages are text; send token ids to /generate (input_ids) or /v1/completions "
                      "(prompt)", "messages")
    tool_request = parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tool_request and tool_request.offered and not rt.tokenizer.renders_tools:
        raise APIError(f"tools: the chat template of {rt.model.model_name} does not show tools to the model; start "
                       "the server with --chat-template naming a template that does (shipped: chatml-tools for "
                       "ChatML models, llama3-tools), or send tool_choice 'none'", param="tools")
    if tool_request and tool_request.constrained and _constraint_fields(body)[1]:
        raise APIError(f"tool_choice '{tool_request.choice if tool_request.choice != 'named' else tool_request.named}' "
                       f"constrains the reply to tool calls: leave {_constraint_fields(body)[1]} out",
                       param="tool_choice")
    messages = template_messages([{"role": m.role, "content": _message_text(m.content), "tool_calls": m.tool_calls,
                                   "tool_call_id": m.tool_call_id, "name": m.name} for m in body.messages])
    offered = [t.as_template_tool() for t in tool_request.offered] if tool_request else None
    size = sum(len(m["content"]) for m in messages) + len(json.dumps(offered or []))
    try:  # a multi-megabyte conversation takes seconds to render and tokenize: not on the event loop
        prompt = await sized(size, rt.tokenizer.apply_chat_template, messages, True, offered)
    except Exception as exc:
        raise APIError(f"cannot apply the chat template: {exc}", param="messages") from exc
    ids = await sized(size, rt.tokenizer.encode, prompt, add_special_tokens=False)
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, max_field)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"{max_field} must be at least 1", param=max_field)
    n_top = body.top_logprobs or 0
    # by default the reply may fill the rest of the context (at least one token: a prompt too long
    # for the context is then reported as such by check_fits)
    room = max(rt.model.config.max_position_embeddings - len(ids), 1)
    tool_constraint = ({"json_schema": json.dumps(tool_request.constraint_schema())}
                       if tool_request and tool_request.constrained else {})
    params = _params(body, max_tokens, room, logprobs=body.logprobs, top_logprobs_num=n_top if body.logprobs else 0,
                     **tool_constraint)
    await check_constraint(rt, params, where="request",
                           field="tools" if tool_constraint else _constraint_fields(body)[1])
    await sized(len(ids), check_fits, rt, ids, params, prompt_field="messages", max_field=max_field)
    if body.logprobs:  # before anything is submitted: nothing runs while the handler waits
        await token_bytes_ready(rt.tokenizer)
    states = await _submit_all(rt, [(ids, sample) for sample in per_sample(params, body.n)], body.rid, body.priority)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    cursors = [LogprobCursor(rt.tokenizer, n_top) for _ in states]
    fmt = parser_for(rt.args.tool_call_parser, getattr(rt.tokenizer.hf, "chat_template", None))

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(i, delta, reason=None, state=None):
            """A chunk of choice i; with `state`, the log-probabilities of the tokens since its last chunk."""
            entries = cursors[i].chat(state) if body.logprobs and state is not None else []
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": i, "delta": delta, "logprobs": {"content": entries} if entries else None,
                                     "finish_reason": reason}]})

        readers = [CallReader(tool_request, fmt) if tool_request and tool_request.choice != "none" else None
                   for _ in states]

        async def events():
            for i in range(len(states)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async with aclosing(merged_updates(rt, states)) as updates:
                async for i, u in updates:
                    reason = u.state.finish_json or {}
                    if reason.get("type") == "abort" and not u.state.cancelled:
                        yield sse(stream_error_event(reason.get("message", "request failed"), 503))
                        continue
                    if readers[i] is None:
                        if u.delta or u.done:
                            yield chunk(i, {"content": u.delta} if u.delta else {}, _finish_reason(u.state.finish_json),
                                        u.state)
                        continue
                    shown = readers[i].feed(u.delta)
                    if not u.done:
                        if shown:
                            yield chunk(i, {"content": shown}, state=u.state)
                        continue
                    rest, calls = readers[i].finish()
                    if shown + rest:
                        yield chunk(i, {"content": shown + rest}, state=u.state)
                    for k, call in enumerate(calls):
                        yield chunk(i, {"tool_calls": [call.as_openai(k)]})
                    yield chunk(i, {}, _chat_finish_reason(u.state.finish_json, calls), u.state)
            if include_usage:
                yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": _usage(states)})

        return EventStream(events(), rt, states)

    finals = await _finals(request, rt, states)
    choices = []
    for i, u in enumerate(finals):
        content, calls = read_calls(u.text, tool_request, fmt) if tool_request else (u.text, [])
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": cursors[i].chat(u.state)} if body.logprobs else None,
                        "finish_reason": _chat_finish_reason(u.state.finish_json, calls)})
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": _usage([u.state for u in finals])})
