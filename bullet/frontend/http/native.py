"""SGLang's native endpoints: /generate (single and batch, n samples, stream and not, logprobs,
max_new_tokens 0), /abort_request, /model_info, /server_info (and their get_ spellings), /health,
/health_generate, /flush_cache."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from bullet import __version__
from bullet.frontend.http.errors import APIError, stream_error_event
from bullet.frontend.http.generate_items import Item, prepare
from bullet.frontend.http.generation import ClientGone, Update, follow, latency, run_all, run_to_completion, submit, submit_all
from bullet.frontend.http.offload import sized
from bullet.frontend.http.protocol import AbortBody, GenerateBody, read_body
from bullet.frontend.http.streaming import EventStream, merged_updates, sse
from engines.sampling_params import SamplingParams

router = APIRouter()
CANCELLED = "aborted by /abort_request"


def _entries(tok, lps, ids, with_text: bool) -> list:
    return [[lp, t, tok.id_to_text(t) if with_text else None] for lp, t in zip(lps, ids)]


def _tops(tok, tops, with_text: bool) -> list:
    """Top log-probabilities per position, SGLang's shape: [[logprob, token id, text|None], ...] or None."""
    return [None if top is None else [[lp, t, tok.id_to_text(t) if with_text else None] for t, lp in top]
            for top in tops]


def _response(rt, u: Update, item: Item, with_text: bool) -> dict:
    st = u.state
    meta = {"id": st.rid, "finish_reason": st.finish_json, "prompt_tokens": len(st.prompt_ids),
            "completion_tokens": len(st.output_ids), "cached_tokens": st.cached_tokens}
    if st.done:
        meta["e2e_latency"] = latency(st)
    if item.logprob:
        tok = rt.tokenizer
        start = min(max(item.start, 0), len(st.prompt_ids))
        with_prompt = item.start >= 0
        meta["input_token_logprobs"] = (_entries(tok, (st.prompt_logprobs or [])[start:], st.prompt_ids[start:],
                                                 with_text) if with_prompt else [])
        meta["output_token_logprobs"] = _entries(tok, st.output_logprobs, st.output_ids, with_text)
        if item.top:
            meta["input_top_logprobs"] = (_tops(tok, (st.prompt_top_logprobs or [])[start:], with_text)
                                          if with_prompt else [])
            meta["output_top_logprobs"] = _tops(tok, st.output_top_logprobs, with_text)
    if rt.tokenizer is None:  # SGLang's shape with skip_tokenizer_init: ids, no "text"
        return {"output_ids": list(st.output_ids), "meta_info": meta}
    return {"text": u.text, "output_ids": list(st.output_ids), "meta_info": meta}


async def _render(rt, u: Update, item: Item, with_text: bool) -> dict:
    # a long prompt's log-probabilities, as text, take a while to render: not on the event loop
    size = len(u.state.prompt_ids) if item.logprob and item.start >= 0 else 0
    return await sized(size, _response, rt, u, item, with_text)


def _server_failure(u: Update) -> str | None:
    """Why the server failed this request, if it did (a request the client aborted did not fail)."""
    reason = u.state.finish_json or {}
    return reason.get("message") if reason.get("type") == "abort" and not u.state.cancelled else None


@router.post("/generate")
async def generate(request: Request):
    rt = request.app.state.runtime
    body = await read_body(request, GenerateBody)
    items, batch = await prepare(rt, body)
    states = await submit_all(rt, [(it.ids, it.params, it.rid, it.group, body.priority) for it in items],
                              "another item of the batch was rejected")
    with_text = body.return_text_in_logprobs
    if body.stream:
        return EventStream(_events(rt, items, states, batch, with_text), rt, states)
    try:
        finals = await run_all(request, rt, states)
    except ClientGone:
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    failed = [m for m in map(_server_failure, finals) if m]
    if failed:
        raise APIError(failed[0], status=503, type_="server_error")
    out = [await _render(rt, u, item, with_text) for u, item in zip(finals, items)]
    return JSONResponse(out if batch else out[0])


async def _events(rt, items, states, batch: bool, with_text: bool):
    async with aclosing(merged_updates(rt, states)) as updates:
        async for i, u in updates:
            failure = _server_failure(u) if u.done else None
            if failure:
                yield sse(stream_error_event(failure, 503))
                continue
            event = await _render(rt, u, items[i], with_text)
            if batch:
                event["index"] = i
            yield sse(event)


@router.post("/abort_request")
async def abort_request(request: Request):
    """SGLang's endpoint: abort the request a rid names (with n > 1, each of its samples), or every
    request with abort_all. Each ends with finish_reason {"type": "abort"} in its own response. An
    unknown or finished rid is not an error (the request may have just finished), as in SGLang."""
    rt = request.app.state.runtime
    body = await read_body(request, AbortBody)
    if not body.abort_all and not body.rid:
        raise APIError("give the rid of the request to abort, or abort_all: true", param="rid")
    states = list(rt.client.inflight.values()) if body.abort_all else rt.client.find(body.rid)
    await rt.client.cancel(states, CANCELLED)
    return JSONResponse({"aborted": [st.rid for st in states]})


def model_info(rt) -> dict:
    shared = rt.model
    return {"model_path": str(rt.args.model_path or rt.model_source), "tokenizer_path": shared.tokenizer_dir,
            "is_generation": True, "served_model_name": shared.model_name,
            "max_context_length": shared.config.max_position_embeddings, "weight_version": "default",
            "preferred_sampling_params": None}


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request):
    return model_info(request.app.state.runtime)


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request):
    rt = request.app.state.runtime
    info = rt.args.model_dump()
    info.pop("api_key", None)
    info.update(version=__version__, status=rt.status, internal_states=[rt.internal_state()])
    return info


@router.get("/health")
async def health(request: Request):
    rt = request.app.state.runtime
    if rt.healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": rt.status, "error": rt.last_failure}, status_code=503)


@router.get("/health_generate")
async def health_generate(request: Request):
    rt = request.app.state.runtime
    if not rt.healthy:
        return JSONResponse({"status": rt.status}, status_code=503)
    try:
        state = await submit(rt, [rt.model.config.bos_token_id or 1], SamplingParams(max_new_tokens=1, temperature=0))
        final = await asyncio.wait_for(run_to_completion(request, follow(rt, state)), timeout=60)
    except (APIError, asyncio.TimeoutError, ClientGone) as exc:
        return JSONResponse({"status": "unhealthy", "error": str(exc) or type(exc).__name__}, status_code=503)
    if _server_failure(final):
        return JSONResponse({"status": "unhealthy", "error": _server_failure(final)}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    """SGLang's endpoint: empty the prefix cache — only when no request is running or waiting (their
    pages are in use), else 400 and nothing is done. The worker that owns the cache frees every
    unreferenced page as soon as it reads the message (`kv_pages_cached` in /server_info)."""
    rt = request.app.state.runtime
    if rt.client.inflight:
        return JSONResponse({"message": "Cache not flushed: requests are running or waiting.",
                             "running_requests": len(rt.client.inflight)}, status_code=400)
    await rt.client.flush_cache()
    return JSONResponse({"message": "Cache flushed.", "timestamp": time.time()})
