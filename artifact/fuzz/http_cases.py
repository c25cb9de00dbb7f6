"""Generated HTTP requests, good and bad, for every endpoint of the server.

Each `Case` says what a correct server does with it: `ok` (a 2xx), `reject` (a 4xx; a 2xx is
reported as lenient, not as a failure — a server may reasonably accept some odd inputs) or
`survive` (any answer or a closed connection, as long as the server stays up and answers the next
request). Whatever the expectation, a 5xx, a hang or a dead server is a failure.

Categories, with the share of cases each gets (`MIX`): good requests of every endpoint; malformed
JSON; wrong types; huge, negative and non-finite numbers; lone surrogates and invalid UTF-8;
deep nesting; oversized bodies; raw protocol abuse (lying Content-Length, garbage request lines,
huge headers, half-sent bodies); streams the client abandons; unknown routes and methods; and
random mutations of good bodies."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

OK, REJECT, SURVIVE = "ok", "reject", "survive"
JSON_ALPHABET = b'{}[]",:0123456789-+.eE\\u ntrufals'
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near "
         "an old harbour city where engineers measure latency and throughput of language models").split()


@dataclass(frozen=True)
class Case:
    category: str
    method: str
    path: str
    body: bytes | None = None
    expect: str = REJECT
    action: str = "send"  # send | stream-abort | raw | client-timeout
    raw: bytes | None = None  # the whole request, for action "raw"
    headers: dict = field(default_factory=lambda: {"Content-Type": "application/json"})
    note: str = ""

    def describe(self, limit: int = 160) -> str:
        payload = self.raw if self.action == "raw" else self.body
        shown = "" if payload is None else repr(payload[:limit]) + ("…" if len(payload) > limit else "")
        return f"{self.method} {self.path[:80]} [{self.category}/{self.note or self.action}] {shown}"


def dumps(obj) -> bytes:
    """JSON as a client would send it; ensure_ascii turns a lone surrogate into a \\udXXX escape."""
    return json.dumps(obj, ensure_ascii=True).encode()


class CaseGenerator:
    def __init__(self, rng: random.Random, model: str, vocab_size: int, max_body_mb: float = 16.0):
        self.rng, self.model, self.vocab, self.max_body = rng, model, vocab_size, int(max_body_mb * 2**20)

    # ---- bodies --------------------------------------------------------------------------------

    def prompt(self, lo: int = 3, hi: int = 40) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def tokens(self) -> int:
        return self.rng.randint(1, 6)

    def generate_body(self, stream: bool = False) -> dict:
        r = self.rng
        body = {"sampling_params": {"max_new_tokens": self.tokens(), "temperature": r.choice([0, 0.7, 1.0])}}
        kind = r.random()
        if kind < 0.6:
            body["text"] = self.prompt()
        elif kind < 0.8:
            body["input_ids"] = [r.randrange(1, self.vocab) for _ in range(r.randint(1, 30))]
        else:
            body["text"] = [self.prompt() for _ in range(r.randint(2, 3))]
        if r.random() < 0.2:
            body.update(return_logprob=True, top_logprobs_num=r.randint(0, 3))
        if stream:
            body["stream"] = True
        return body

    def completion_body(self, stream: bool = False) -> dict:
        return {"model": self.model, "prompt": self.prompt(), "max_tokens": self.tokens(), "stream": stream,
                "temperature": self.rng.choice([0, 0.8])}

    def chat_body(self, stream: bool = False) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": self.prompt()}],
                "max_tokens": self.tokens(), "stream": stream}

    def good_post(self) -> tuple[str, dict]:
        path = self.rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        stream = self.rng.random() < 0.3
        body = {"/generate": self.generate_body, "/v1/completions": self.completion_body,
                "/v1/chat/completions": self.chat_body}[path](stream)
        return path, body

    # ---- categories ----------------------------------------------------------------------------

    def good(self) -> Case:
        r = self.rng.random()
        if r < 0.25:
            path = self.rng.choice(["/health", "/model_info", "/get_model_info", "/server_info", "/get_server_info",
                                    "/v1/models", "/metrics", "/", "/flush_cache", "/health_generate"])
            # /flush_cache refuses (400) while requests run, as SGLang's does: either answer is right
            return Case("good", "GET", path, expect=SURVIVE if path == "/flush_cache" else OK, note="get")
        if r < 0.3:
            return Case("good", "POST", "/abort_request", dumps({"rid": f"fuzz-unknown-{self.rng.random()}"}), OK)
        path, body = self.good_post()
        return Case("good", "POST", path, dumps(body), OK, note="stream" if body.get("stream") else "")

    def malformed_json(self) -> Case:
        path, body = self.good_post()
        text = dumps(body)
        r = self.rng
        variants = [text[: r.randrange(1, len(text))], text + b"}", text + b" trailing", text.replace(b'"', b"'"),
                    b"", b"{", b"null", b"[]", b"123", b'"a string"', b'{"text": "a", }', b'{"text": NaN}',
                    b'{"text": "a" /* comment */}', b"\xef\xbb\xbf" + text, bytes(r.randrange(256) for _ in range(64)),
                    text.replace(b":", b"=", 1), b'{"text": "\xff\xfe"}', b'{"text": "\x00"}']
        i = r.randrange(len(variants))
        expect = SURVIVE if i == 13 else REJECT  # a UTF-8 BOM some parsers accept
        return Case("malformed_json", "POST", path, variants[i], expect, note=f"variant{i}")

    WRONG = {"text": [5, {}, True, [1, 2], [[{}]]], "input_ids": ["abc", [1.5], [[1], "x"], {"a": 1}, [None]],
             "sampling_params": ["x", 5, [1, 2]], "stream": ["yes", 1, {}], "max_tokens": ["8", 8.5, [], {}],
             "prompt": [5.5, {}, [None], True], "messages": ["hi", [1], [{"role": 5, "content": "x"}],
                                                              [{"role": "user", "content": {"a": 1}}], [{}]],
             "model": [7, [], {}], "stop": [5, [1, 2], {}], "n": ["2", 2.5], "temperature": ["hot", [], {}],
             "rid": [5, {}, [[]]], "return_logprob": ["no", [[]]], "top_logprobs_num": ["3", 1.5]}
    WRONG_SAMPLING = {"max_new_tokens": ["8", 8.5, [], None, True], "temperature": ["hot", [1]],
                      "top_p": ["1"], "top_k": [1.5, "5"], "stop": [5, [None]], "stop_token_ids": ["x", [1.5]],
                      "seed": ["x", 1.5], "ignore_eos": ["no"], "n": [1.5, "2"]}

    FIELDS = {"/generate": ["text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
                            "top_logprobs_num"],
              "/v1/completions": ["prompt", "max_tokens", "stream", "model", "stop", "n", "temperature", "rid"],
              "/v1/chat/completions": ["messages", "max_tokens", "stream", "model", "stop", "n", "temperature", "rid"]}

    def wrong_types(self) -> Case:
        path, body = self.good_post()
        r = self.rng
        if path == "/generate" and r.random() < 0.5:
            key = r.choice(list(self.WRONG_SAMPLING))
            body["sampling_params"][key] = r.choice(self.WRONG_SAMPLING[key])
        else:  # only fields the endpoint reads: an unknown field is ignored, not a type error
            key = r.choice(self.FIELDS[path])
            body[key] = r.choice(self.WRONG[key])
            if key == "text":
                body.pop("input_ids", None)
            elif key == "input_ids":
                body.pop("text", None)
        # null for an optional field is defensible (reported as lenient); everything else must be a 4xx
        return Case("wrong_types", "POST", path, dumps(body), REJECT, note=key)

    BIG = [-1, -(2**31), 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, 1e308, -1e308, 1e-320]

    def numbers(self) -> Case:
        path, body = self.good_post()
        r = self.rng
        value = r.choice(self.BIG)
        if path == "/generate":
            key = r.choice(["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                            "frequency_penalty", "presence_penalty", "min_new_tokens", "stop_token_ids"])
            body["sampling_params"][key] = [value] if key == "stop_token_ids" else value
            if r.random() < 0.2:
                body = {"input_ids": [r.choice([-1, self.vocab, 2**40, 2**64])], "sampling_params": {"max_new_tokens": 2}}
                key = "input_ids"
        else:
            key = r.choice(["max_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs", "min_tokens"])
            body[key] = value
        text = dumps(body)
        if r.random() < 0.15:  # literals json.dumps will not write
            if path == "/generate":
                # a field the body does not set already (JSON's last duplicate would win)
                text = text.replace(b'"sampling_params": {', b'"sampling_params": {"repetition_penalty": -Infinity, ', 1)
            else:
                text = text[:-1] + b', "temperature": Infinity}'
            key += "+Infinity"
        # some of these are valid (seed 2**63 may be clamped, 1e-320 is a temperature); a 2xx is "lenient"
        return Case("numbers", "POST", path, text, REJECT, note=key)

    SURROGATES = ["\ud800", "\udfff", "Hi \ud800 there", "\udc00\ud800", "a\ud83d", "\ude00b"]

    def surrogates(self) -> Case:
        path, body = self.good_post()
        pair = self.rng.random() < 0.15  # a valid pair (an emoji) is fine text: the control case
        s = "smile \ud83d\ude00" if pair else self.rng.choice(self.SURROGATES)
        where = "prompt" if pair else self.rng.choice(["prompt", "stop", "rid", "key"])
        if where == "prompt":
            if path == "/generate":
                body.pop("input_ids", None)
                body["text"] = s
            elif path == "/v1/completions":
                body["prompt"] = s
            else:
                body["messages"][0]["content"] = s
        elif where == "stop":
            (body["sampling_params"] if path == "/generate" else body)["stop"] = [s]
        elif where == "rid":
            body["rid"] = [s] * len(body["text"]) if isinstance(body.get("text"), list) else s
        else:
            body[s] = 1
        # an unknown top-level key is ignored, so a surrogate there may be accepted
        expect = OK if pair else SURVIVE if where == "key" else REJECT
        return Case("surrogates", "POST", path, dumps(body), expect, note="valid-pair" if pair else where)

    def nesting(self) -> Case:
        path, body = self.good_post()
        depth = self.rng.choice([64, 500, 1000, 5000, 50_000, 200_000])
        where = self.rng.choice(["body", "dict", "sampling", "ignored-key"])
        if where == "body":
            text = b"[" * depth + b"]" * depth
        elif where == "dict":
            text = b'{"a":' * depth + b"1" + b"}" * depth
        else:  # json.dumps would recurse: splice the nested value in as bytes
            key = "sampling_params" if where == "sampling" and path == "/generate" else "deep"
            body.pop(key, None)
            nested = b"[" * depth + b'"x"' + b"]" * depth
            text = dumps(body)[:-1] + b', "' + key.encode() + b'": ' + nested + b"}"
            where = "sampling" if key == "sampling_params" else "ignored-key"
        # a deep value under a key the server ignores may be accepted; anything else is a 4xx
        return Case("nesting", "POST", path, text, SURVIVE if where == "ignored-key" else REJECT,
                    note=f"{where}-{depth}")

    def oversized(self) -> Case:
        r = self.rng
        mb = r.choice([1, 4, self.max_body / 2**20])
        size = int(mb * 2**20)
        kind = r.choice(["text", "ids", "batch", "messages"])
        if kind == "text":
            body = b'{"text": "' + b"a " * (size // 2) + b'", "sampling_params": {"max_new_tokens": 1}}'
            path = "/generate"
        elif kind == "ids":
            body = b'{"input_ids": [' + b"1," * (size // 2) + b'1], "sampling_params": {"max_new_tokens": 1}}'
            path = "/generate"
        elif kind == "batch":
            n = max(2, size // 16)
            body = dumps({"text": ["hello world"] * n, "sampling_params": {"max_new_tokens": 1}})
            path = "/generate"
        else:
            n = max(2, size // 40)
            body = dumps({"model": self.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * n})
            path = "/v1/chat/completions"
        return Case("oversized", "POST", path, body, REJECT, note=f"{kind}-{len(body) >> 20}MB")

    def protocol(self) -> Case:
        r = self.rng
        body = dumps(self.generate_body())
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        variants = {
            "length-too-long": head + b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body,
            "length-too-short": head + b"Content-Length: 5\r\n\r\n" + body,
            "length-garbage": head + b"Content-Length: abc\r\n\r\n" + body,
            "length-negative": head + b"Content-Length: -5\r\n\r\n" + body,
            "half-body-then-close": head + b"Content-Length: 100000\r\n\r\n" + body,
            "bad-chunks": head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
            "garbage-line": bytes(r.randrange(32, 127) for _ in range(200)) + b"\r\n\r\n",
            "binary-line": bytes(r.randrange(256) for _ in range(200)) + b"\r\n\r\n",
            "http09": b"GET /health\r\n\r\n",
            "huge-header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
            "many-headers": b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(5000)) + b"\r\n",
            "bad-version": b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
            "huge-url": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            # sent raw: an HTTP client library would normalize these before they left
            "path-traversal": b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
            "bad-percent": b"GET /health?%zz=%%&\xff HTTP/1.1\r\nHost: x\r\n\r\n",
            "non-ascii-path": "GET /v1/models/\u00e9\u4e2d HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        }
        name = r.choice(list(variants))
        return Case("protocol", "RAW", "/generate", expect=SURVIVE, action="raw", raw=variants[name], note=name)

    def aborted(self) -> Case:
        path, body = self.good_post()
        body["stream"] = True
        if path == "/generate":
            body["sampling_params"]["max_new_tokens"] = 48
        else:
            body["max_tokens"] = 48
        if self.rng.random() < 0.3:  # a non-streaming request whose client stops waiting
            body["stream"] = False
            return Case("aborted", "POST", path, dumps(body), SURVIVE, action="client-timeout")
        return Case("aborted", "POST", path, dumps(body), SURVIVE, action="stream-abort")

    def routes(self) -> Case:
        r = self.rng
        method, path = r.choice([("GET", "/generate"), ("PUT", "/v1/completions"), ("DELETE", "/health"),
                                 ("POST", "/v1/embeddings"), ("POST", "/health"), ("PATCH", "/server_info"),
                                 ("GET", "/v1/chat/completions"), ("GET", "/nope/" + "x" * 5000),
                                 ("OPTIONS", "/generate"), ("POST", "/v1/completions/extra")])
        return Case("routes", method, path, dumps(self.generate_body()) if method != "GET" else None, REJECT)

    def mutation(self) -> Case:
        path, body = self.good_post()
        data = bytearray(dumps(body))
        r = self.rng
        for _ in range(r.randint(1, 6)):
            op = r.randrange(4)
            i = r.randrange(len(data)) if data else 0
            if op == 0 and data:
                data[i] = r.randrange(256)
            elif op == 1:
                data[i:i] = bytes(r.choice(JSON_ALPHABET) for _ in range(r.randint(1, 4)))
            elif op == 2 and data:
                del data[i:i + r.randint(1, 8)]
            else:
                data[i:i] = r.choice([b'"\\ud800"', b"1e999", b"-0", b"[[[[", b"null", b'"\\u0000"', b"\xc3\x28"])
        return Case("mutation", "POST", path, bytes(data), SURVIVE)

    MIX = [("good", 0.08), ("malformed_json", 0.13), ("wrong_types", 0.14), ("numbers", 0.14), ("surrogates", 0.07),
           ("nesting", 0.05), ("oversized", 0.01), ("protocol", 0.05), ("aborted", 0.03), ("routes", 0.05),
           ("mutation", 0.25)]

    def next(self) -> Case:
        names, weights = zip(*self.MIX)
        return getattr(self, self.rng.choices(names, weights)[0])()
