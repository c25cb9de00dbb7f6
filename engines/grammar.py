"""Constrained decoding with xgrammar: a request's output follows a regular expression, a JSON schema,
an EBNF grammar or a structural tag (`SamplingParams.constraint`).

Three pieces, each used where it belongs:

* `check(kind, text)` parses a grammar without a tokenizer (milliseconds) and raises `GrammarError`
  with xgrammar's own message: the frontend and the offline API call it before a request is
  submitted, so a bad grammar is a 400 and never reaches a worker.
* `Grammars` compiles grammars against the model's vocabulary, once per distinct (kind, text), in a
  background thread (xgrammar releases the GIL while it compiles), and keeps the compiled ones in a
  bounded LRU cache. Each process that samples (the prefill and decode workers, the unified worker,
  the offline engine) has its own: a compiled grammar is a C++ object that never crosses a process
  boundary. A worker starts compiling when a request arrives (`prefetch`), so by the time the
  request's first token is sampled — after its prompt's layers — the grammar is usually ready.
* `Matcher` is one request's position in its grammar, in one process. Its state is a function of
  the grammar and the output tokens so far, so it is never sent anywhere: a worker that takes a
  request over (decode after prefill's first token, prefill recomputing a request decode gave back)
  builds a fresh matcher and advances it over the tokens the request already has (`follow`).

The sampler (`engines.sampler`) only sees the packed bitmask a matcher fills: bit t % 32 of word
t // 32 is set when token t may come next. End-of-sequence is allowed only where the grammar may end.

xgrammar is imported on first use: a server that never sees a constrained request never loads it."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

import torch

KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
CAPACITY = 64  # compiled grammars kept per process
CAPACITY_BYTES = 512 << 20  # and at most this much of them (xgrammar's own estimate)
CHECKED = 512  # grammars the frontend remembers as valid or not (texts up to CHECK_CACHE_CHARS)
CHECK_CACHE_CHARS = 64 << 10
# the longest a sampling step waits for a grammar still compiling (typical ones take milliseconds: a
# 40-property schema ~20 ms, a{20000} ~0.2 s); past it the request fails, the worker goes on
COMPILE_WAIT_S = 60.0
# xgrammar's C++ errors start with a timestamp and a source location: "[12:00:00] /x/y.cc:94: ..."
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


class GrammarError(ValueError):
    """A grammar that cannot be used; the message is xgrammar's, without its source location."""


def _xgr():
    import xgrammar  # deferred: ~0.7 s and transformers, paid only by a process that meets a grammar

    return xgrammar


def error_message(exc: BaseException) -> str:
    """xgrammar's message, first line, without the C++ timestamp and source location."""
    text = str(exc).strip()
    text = _CHECK_FAILED.sub("", _LOCATION.sub("", text))
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:500]


def _structural_tag_json(text: str) -> str:
    """xgrammar's structural tag as JSON text. Two shapes are accepted: xgrammar's own
    (`{"type": "structural_tag", "format": {...}}`) and the one SGLang's API documents
    (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`), converted to the former."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise GrammarError("a structural tag must be a JSON object")
    if "structures" not in tag and "triggers" not in tag:
        return text
    xgr = _xgr()
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            and isinstance(s.get("schema", {}), dict) for s in structures) or not all(isinstance(t, str) for t in triggers):
        raise GrammarError("a structural tag's 'structures' must be a list of {begin, schema, end} objects and its "
                           "'triggers' a list of strings")
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
             for s in structures]
    return xgr.StructuralTag.from_legacy_structural_tag(items, triggers).model_dump_json()


# Whitespace xgrammar allows in one place of a JSON output. Unbounded, a small model can write newlines
# until max_new_tokens (SmolLM2-135M: 3 of 240 sampled requests, artifact/benchmarks/bench_structured.py);
# JSON's meaning never depends on it, and 16 holds a newline and any sane indentation.
JSON_MAX_WHITESPACE = 16
# JSON-schema keywords xgrammar 0.2.9 compiles but does not enforce (checked: a schema with each accepts
# a value that breaks it). A request using one is refused rather than answered with output that may break it.
UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")  # keys below these are names, not keywords
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems", "unevaluatedProperties",
        "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced_keywords(schema, path: str = "") -> list[str]:
    """Where `schema` uses a keyword of UNENFORCED (as JSON-pointer-like paths)."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path}/{k}" for k in UNENFORCED if k in schema and not (k == "uniqueItems" and schema[k] is False)]
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unenforced_keywords(sub, f"{path}/{key}/{name}")
    for key in _ONE:
        sub = schema.get(key)
        if isinstance(sub, list):  # the old tuple form of items
            for i, s in enumerate(sub):
                found += unenforced_keywords(s, f"{path}/{key}/{i}")
        else:
            found += unenforced_keywords(sub, f"{path}/{key}")
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unenforced_keywords(sub, f"{path}/{key}/{i}")
    return found


def refuse_unenforced(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        return  # xgrammar reports the JSON error in its own words
    found = unenforced_keywords(schema)
    if found:
        raise GrammarError(f"the schema uses {', '.join(found[:5])}: the constrained decoder (xgrammar) does not "
                           f"enforce {', '.join(sorted({f.rsplit('/', 1)[1] for f in found}))}, so the output could "
                           "break the schema; remove it (and check that part of the output yourself)")


def parse(kind: str, text: str):
    """The xgrammar `Grammar` for a constraint (no tokenizer needed); raises GrammarError."""
    xgr = _xgr()
    try:
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "json_schema":
            refuse_unenforced(text)
            # strict: only the schema's properties (SGLang's default); whitespace between tokens bounded
            return xgr.Grammar.from_json_schema(text, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(_structural_tag_json(text))
    except GrammarError:
        raise
    except Exception as exc:  # RuntimeError from C++, InvalidJSONError, pydantic's ValidationError, ...
        raise GrammarError(error_message(exc)) from None
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


_checked: OrderedDict[tuple[str, str], str | None] = OrderedDict()
_checked_lock = threading.Lock()


def checked(kind: str, text: str) -> bool:
    """Whether `check(kind, text)` has an answer cached (it then returns at once)."""
    with _checked_lock:
        return (kind, text) in _checked


def check(kind: str, text: str) -> None:
    """Raises GrammarError when `text` is not a valid grammar of `kind` (answers are cached)."""
    key = (kind, text)
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            error = _checked[key]
            if error is not None:
                raise GrammarError(error)
            return
    try:
        parse(kind, text)
        error = None
    except GrammarError as exc:
        error = str(exc)
    if len(text) <= CHECK_CACHE_CHARS:
        with _checked_lock:
            _checked[key] = error
            while len(_checked) > CHECKED:
                _checked.popitem(last=False)
    if error is not None:
        raise GrammarError(error)


def tokenizer_info_from_dir(directory: str, vocab_size: int, stop_token_ids: Sequence[int]):
    """xgrammar's view of the model's vocabulary, from a Hugging Face tokenizer directory (what
    a worker has: `SharedModel.tokenizer_dir`)."""
    from transformers import AutoTokenizer  # deferred: loaded with xgrammar, by a process that meets a grammar

    return tokenizer_info(AutoTokenizer.from_pretrained(directory), vocab_size, stop_token_ids)


def tokenizer_info(hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
    """`vocab_size` is the model's (its logits' width), which may exceed the tokenizer's.
    `stop_token_ids`: the tokens that end a sequence, allowed where the grammar may end."""
    return _xgr().TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                 stop_token_ids=sorted(stop_token_ids) or None)


class Grammars:
    """One process's compiled grammars: compiled in a background thread, at most `capacity` of
    them (and `capacity_bytes`) kept, least recently used dropped first. A matcher keeps its own
    grammar alive, so dropping one from the cache never affects a running request."""

    def __init__(self, tokenizer_info: Callable[[], object], capacity: int = CAPACITY,
                 capacity_bytes: int = CAPACITY_BYTES):
        self._make_info = tokenizer_info  # called once, in the compile thread (it may take a second)
        self.capacity, self.capacity_bytes = capacity, capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self.compiled_count = 0  # grammars compiled so far (a cache hit compiles nothing)

    @classmethod
    def for_tokenizer_dir(cls, directory: str, vocab_size: int, stop_token_ids: Sequence[int], **kw) -> "Grammars":
        return cls(lambda: tokenizer_info_from_dir(directory, vocab_size, stop_token_ids), **kw)

    def prefetch(self, constraint: tuple[str, str] | None) -> Future | None:
        """Start compiling `constraint` (kind, text) unless it is cached or being compiled."""
        if constraint is None:
            return None
        with self._lock:
            future = self._entries.get(constraint)
            if future is not None:
                self._entries.move_to_end(constraint)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, *constraint)
            self._entries[constraint] = future
            self._trim()
            return future

    def compiled(self, constraint: tuple[str, str], timeout: float = COMPILE_WAIT_S):
        """The compiled grammar (waiting for its compilation); raises GrammarError."""
        try:
            return self.prefetch(constraint).result(timeout)
        except FutureTimeout:
            raise GrammarError(f"compiling the grammar took more than {timeout:g} s") from None

    def matcher(self, constraint: tuple[str, str]) -> "Matcher":
        return Matcher(self.compiled(constraint))

    def _compile(self, kind: str, text: str):
        if self._compiler is None:
            xgr = _xgr()
            # its own cache off: this class is the cache (bounded, keyed by kind and text)
            self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=1, cache_enabled=False)
        grammar = parse(kind, text)
        try:
            result = self._compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(error_message(exc)) from None
        self.compiled_count += 1
        with self._lock:
            self._trim()
        return result

    def _trim(self) -> None:
        """Drop the least recently used finished entries beyond the bounds (call with the lock)."""
        done = [(k, f) for k, f in self._entries.items() if f.done()]
        size = sum(f.result().memory_size_bytes for _, f in done if f.exception() is None)
        for key, future in done:
            if len(self._entries) <= self.capacity and size <= self.capacity_bytes:
                break
            if future.exception() is None:
                size -= future.result().memory_size_bytes
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """One request's position in its grammar, in this process. `consumed` output tokens have been
    accepted; `follow` catches up with tokens sampled elsewhere (another worker, before a hand-over)."""

    def __init__(self, compiled):
        self._m = _xgr().GrammarMatcher(compiled)
        self.consumed = 0

    def follow(self, output_ids: Sequence[int]) -> None:
        """Accept output_ids[consumed:]; raises GrammarError if one of them does not fit."""
        for token in output_ids[self.consumed:]:
            if not self.accept(token):
                raise GrammarError(f"output token {token} (position {self.consumed}) does not fit the grammar")

    def accept(self, token: int) -> bool:
        if self._m.is_terminated() or not self._m.accept_token(int(token)):
            return False
        self.consumed += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted where it may end): nothing may follow."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens that may come next into row `row` of a packed bitmask."""
        self._m.fill_next_token_bitmask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with every token its row's packed mask disallows set to -inf, in place.
    xgrammar's own kernel reads the packed words directly (at batch 16 over SmolLM2's 49k tokens it
    takes half the time of unpacking the bits with torch first); float32 CPU rows only — any other
    dtype or device takes the torch path (`engines.sampler.unpack_bitmask`)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise TypeError("xgrammar's CPU kernel takes float32 CPU logits")
    words = bitmask_words(logits.shape[-1])
    packed = packed.to(torch.int32)
    if packed.shape[1] < words:  # a mask narrower than the logits allows none of the extra tokens
        packed = torch.nn.functional.pad(packed, (0, words - packed.shape[1]), value=0)
    _xgr().apply_token_bitmask_inplace(logits, packed[:, :words].contiguous())
    return logits

