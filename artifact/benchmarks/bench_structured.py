"""Structured output, served: is every constrained output valid, and what does the constraint cost?

  python artifact/benchmarks/bench_structured.py [--systems bullet chunked:256] [--requests 240]
      [--concurrency 16] [--tokens 64] [--model-path PATH] [--out docs/structured]

For each system (a `bullet launch --policy ...` server on a free port, the same model and flags):

* **validity**: `--requests` constrained requests, sent `--concurrency` at a time, sampled (temperature
  0.8, a seed each) — JSON schemas of everyday API objects (`SCHEMAS`), regular expressions (`REGEXES`)
  and EBNF grammars (`GRAMMARS`) in turn. Each output is checked by a tool other than the one that
  constrained it: JSON with `jsonschema`, regexes and EBNF grammars (regular languages here) with
  Python's `re`. An output cut by `max_new_tokens` is counted apart from an invalid one.
* **overhead**: decode time per output token (TPOT, from the arrival times of the streamed tokens) of
  requests of exactly `--tokens` tokens with a JSON-schema constraint (a list long enough that the grammar
  never ends first) against the same prompts without one (`ignore_eos`), at batch 1 and batch 16, the two
  kinds alternated; the ratio is what the constraint costs.
* **compile**: first-token time of a grammar the server has not seen against the same grammar again
  (its compiled form is cached in each worker), and — in this process, with the model's tokenizer —
  xgrammar's compile time per schema and the cache's hit time.

Writes <out>/structured.json and <out>/structured.md (tables, the machine's CPU flags)."""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from artifact.benchmarks.bench_llamacpp import cpu_flags
from artifact.benchmarks.common import machine
from artifact.server import BulletServer, system_launch
from engines.grammar import Grammars

ROOT = Path(__file__).resolve().parents[2]

# bounded strings and numbers, as an API's schema would have them (an unbounded integer lets a small model
# write digits until max_new_tokens: a cut output, not an invalid one, but no answer either)
STR = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                               "email": STR}, "required": ["name", "age"]},
    "address": {"type": "object", "properties": {"street": STR, "city": STR, "postcode": {"type": "string",
                "pattern": "^[0-9]{5}$"}, "country": {"enum": ["FR", "DE", "US", "JP"]}},
                "required": ["street", "city", "postcode", "country"]},
    "product": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "title": STR, "price": {"type": "number", "minimum": 0, "maximum": 10000}, "in_stock": {"type": "boolean"}},
                "required": ["sku", "title", "price", "in_stock"]},
    "event": {"type": "object", "properties": {"title": STR, "date": {"type": "string", "pattern":
              "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, "attendees": {"type": "array", "items": STR, "maxItems": 3}},
              "required": ["title", "date", "attendees"]},
    "weather": {"type": "object", "properties": {"city": STR, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}}, "required": ["city", "temperature_c",
                                                                                          "condition"]},
    "order": {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 999999}, "lines": {"type": "array", "items": {
              "type": "object", "properties": {"sku": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 2}}, "required": ["order_id", "lines"]},
    "book": {"type": "object", "properties": {"title": STR, "author": STR, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
             "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"}}, "required": ["title", "author", "year"]},
    "movie_review": {"type": "object", "properties": {"movie": STR, "stars": {"type": "integer", "minimum": 1,
                     "maximum": 5}, "summary": {"type": "string", "maxLength": 60}}, "required": ["movie", "stars",
                                                                                                 "summary"]},
    "tool_call": {"type": "object", "properties": {"name": {"enum": ["search", "get_weather", "send_email"]},
                  "arguments": {"type": "object", "properties": {"query": STR}, "required": ["query"]}},
                  "required": ["name", "arguments"]},
    "classification": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["label",
                                                                                                 "confidence"]},
    "user_profile": {"type": "object", "properties": {"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                     "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}, "minItems": 1,
                               "maxItems": 3}, "active": {"type": "boolean"}},
                     "required": ["username", "roles", "active"]},
    "invoice": {"type": "object", "properties": {"number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                "total": {"type": "number", "minimum": 0, "maximum": 1000000}, "currency": {"enum": ["EUR", "USD", "JPY"]}, "paid": {"type": "boolean"}},
                "required": ["number", "total", "currency", "paid"]},
}
REGEXES = {
    "iso_date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "clock_time": r"([01][0-9]|2[0-3]):[0-5][0-9]",
    "email": r"[a-z]{2,10}\.[a-z]{2,10}@[a-z]{3,10}\.(com|org|net)",
    "phone": r"\+[1-9][0-9]{1,2} [0-9]{3} [0-9]{3} [0-9]{4}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "hex_color": r"#[0-9a-f]{6}",
    "semver": r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})",
    "yes_no_reason": r"(Yes|No), because [a-z ]{5,40}\.",
}
# EBNF grammars (xgrammar's dialect) of regular languages, each with the regex that checks it
GRAMMARS = {
    "arithmetic": ('root ::= num (op num){1,4}\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " - " | " * "',
                   r"[1-9][0-9]{0,2}(( \+ | - | \* )[1-9][0-9]{0,2}){1,4}"),
    "color_list": ('root ::= color (", " color){0,3}\ncolor ::= "red" | "green" | "blue" | "yellow" | "purple"',
                   r"(red|green|blue|yellow|purple)(, (red|green|blue|yellow|purple)){0,3}"),
    "key_values": ('root ::= pair (";" pair){0,2}\npair ::= key "=" value\nkey ::= [a-z]{1,8}\nvalue ::= [0-9]{1,4}',
                   r"[a-z]{1,8}=[0-9]{1,4}(;[a-z]{1,8}=[0-9]{1,4}){0,2}"),
}
PROMPTS = {"json_schema": "Answer with a JSON object for a {name}:", "regex": "Write one {name}:",
           "ebnf": "Write one {name}:"}
# the overhead requests: a list the grammar lets grow past --tokens, so no request ends before the others
LONG_LIST = {"type": "object", "properties": {"items": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": STR}, "required": ["id", "name"]}}},
    "required": ["items"]}
LONG_PROMPTS = ["List the items of a grocery order as JSON:", "Give an inventory of a library as JSON:",
                "Write the menu of a small cafe as JSON:", "List planets and moons as JSON:"]


def cases() -> list[tuple[str, str, str, object]]:
    """(kind, name, prompt, constraint) of every constraint: kind in json_schema | regex | ebnf."""
    out = [("json_schema", n, PROMPTS["json_schema"].format(name=n.replace("_", " ")), s) for n, s in SCHEMAS.items()]
    out += [("regex", n, PROMPTS["regex"].format(name=n.replace("_", " ")), r) for n, r in REGEXES.items()]
    out += [("ebnf", n, PROMPTS["ebnf"].format(name=n.replace("_", " ")), g) for n, (g, _) in GRAMMARS.items()]
    return out


def valid(kind: str, name: str, text: str) -> tuple[bool, str]:
    """Whether `text` satisfies the constraint, checked without xgrammar; (ok, why not)."""
    if kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            return False, str(exc).splitlines()[0][:200]
        return True, ""
    pattern = REGEXES[name] if kind == "regex" else GRAMMARS[name][1]
    return (True, "") if re.fullmatch(pattern, text) else (False, f"{text[:80]!r} does not match")


def sampling(kind: str, constraint, **kw) -> dict:
    value = json.dumps(constraint) if kind == "json_schema" else constraint
    return {kind: value, **kw}


def stream_times(server: BulletServer, text: str, params: dict, timeout: float = 600) -> dict:
    """One streamed /generate: the arrival time of each new token, and the final event."""
    import requests

    start, arrivals, last, count = time.perf_counter(), [], None, 0
    with requests.post(server.url + "/generate", json={"text": text, "sampling_params": params, "stream": True},
                       stream=True, timeout=timeout) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            n = event["meta_info"]["completion_tokens"]
            arrivals += [now] * (n - count)
            count, last = n, event
    return {"start": start, "arrivals": arrivals, "final": last}


def tpot_ms(run: dict) -> float | None:
    a = run["arrivals"]
    return (a[-1] - a[0]) / (len(a) - 1) * 1e3 if len(a) > 1 else None


def validity(server: BulletServer, n: int, concurrency: int, max_tokens: int) -> dict:
    all_cases = cases()
    jobs = [(k, all_cases[k % len(all_cases)]) for k in range(n)]

    def one(job):
        k, (kind, name, prompt, constraint) = job
        status, out = server.post("/generate", {"text": prompt, "sampling_params": sampling(
            kind, constraint, max_new_tokens=max_tokens, temperature=0.8, seed=1000 + k)})
        if status != 200:
            return kind, name, "error", str(out)[:200], ""
        if out["meta_info"]["finish_reason"]["type"] == "length":
            return kind, name, "cut", "", out["text"]
        ok, why = valid(kind, name, out["text"])
        return kind, name, "valid" if ok else "invalid", why, out["text"]

    rows = []
    with futures.ThreadPoolExecutor(concurrency) as pool:
        for r in tqdm(pool.map(one, jobs), total=len(jobs), desc="  validity", leave=False):
            rows.append(r)
    per_kind = {}
    for kind, _, verdict, _, _ in rows:
        per_kind.setdefault(kind, {"valid": 0, "invalid": 0, "cut": 0, "error": 0})[verdict] += 1
    bad = [{"kind": k, "name": nm, "verdict": v, "why": w, "text": t[:200]} for k, nm, v, w, t in rows if v != "valid"]
    return {"requests": len(rows), "valid": sum(v == "valid" for _, _, v, _, _ in rows), "per_kind": per_kind,
            "not_valid": bad[:20]}


def overhead(server: BulletServer, batch: int, tokens: int, rounds: int) -> dict:
    """TPOT with and without the constraint, the two kinds alternated round by round."""
    out = {"constrained": [], "unconstrained": []}
    for r in range(rounds):
        for kind in ("unconstrained", "constrained") if r % 2 == 0 else ("constrained", "unconstrained"):
            extra = sampling("json_schema", LONG_LIST) if kind == "constrained" else {"ignore_eos": True}
            params = {"max_new_tokens": tokens, "temperature": 0, **extra}
            prompts = [LONG_PROMPTS[k % len(LONG_PROMPTS)] for k in range(batch)]
            with futures.ThreadPoolExecutor(batch) as pool:
                runs = list(pool.map(lambda p: stream_times(server, p, params), prompts))
            assert all(len(run["arrivals"]) == tokens for run in runs), "a request ended before --tokens"
            out[kind] += [t for t in map(tpot_ms, runs) if t is not None]
    c, u = statistics.mean(out["constrained"]), statistics.mean(out["unconstrained"])
    return {"batch": batch, "tokens": tokens, "tpot_ms_constrained": c, "tpot_ms_unconstrained": u, "ratio": c / u,
            "samples": len(out["constrained"])}


def served_compile(server: BulletServer, fresh_tag: str) -> dict:
    """First-token time of a schema no worker has compiled, then of the same schema again."""
    schema = {"type": "object", "properties": {fresh_tag: {"type": "integer"}, "note": STR}, "required": [fresh_tag]}
    params = sampling("json_schema", schema, max_new_tokens=4, temperature=0)
    first = stream_times(server, "Answer in JSON:", params)
    again = stream_times(server, "Answer in JSON:", params)
    ttft = lambda run: (run["arrivals"][0] - run["start"]) * 1e3  # noqa: E731
    return {"ttft_ms_new_grammar": ttft(first), "ttft_ms_cached_grammar": ttft(again)}


def local_compile(tokenizer_dir: str) -> dict:
    """xgrammar's compile time per schema with the model's tokenizer, and the cache's hit time."""
    from transformers import AutoTokenizer  # deferred: only this part needs it (and it takes seconds)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammars = Grammars.for_tokenizer_dir(tokenizer_dir, len(tok), [tok.eos_token_id])
    grammars.compiled(("regex", "a"))  # builds the tokenizer info (once per process) outside the timing
    compile_ms, hit_ms = [], []
    for schema in SCHEMAS.values():
        key = ("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        grammars.compiled(key)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        grammars.compiled(key)
        hit_ms.append((time.perf_counter() - t0) * 1e3)
    grammars.close()
    return {"schemas": len(compile_ms), "compile_ms_median": statistics.median(compile_ms),
            "compile_ms_max": max(compile_ms), "hit_ms_median": statistics.median(hit_ms)}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Structured output: validity and overhead ({result['model']})", "",
             f"Measured {m['when']} on {m['cpu_count']} cores ({m['platform']}), torch {m['torch']}; CPU flags: "
             f"{' '.join(result['cpu_flags'])}.", f"Command: `{result['command']}`", "",
             "| system | requests | valid | cut at max tokens | invalid | new grammar TTFT ms | cached grammar TTFT ms |",
             "|---|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        v, c = s["validity"], s["compile"]
        cut = sum(k["cut"] for k in v["per_kind"].values())
        bad = sum(k["invalid"] + k["error"] for k in v["per_kind"].values())
        lines.append(f"| {name} | {v['requests']} | {v['valid']} ({100 * v['valid'] / v['requests']:.1f} %) | {cut} | "
                     f"{bad} | {c['ttft_ms_new_grammar']:.0f} | {c['ttft_ms_cached_grammar']:.0f} |")
    lines += ["", "| system | batch | tokens | TPOT constrained ms | TPOT unconstrained ms | ratio |", "|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        for o in s["overhead"]:
            lines.append(f"| {name} | {o['batch']} | {o['tokens']} | {o['tpot_ms_constrained']:.1f} | "
                         f"{o['tpot_ms_unconstrained']:.1f} | {o['ratio']:.3f} |")
    lc = result["local_compile"]
    lines += ["", f"xgrammar compile time per schema (this process, the model's tokenizer): median "
              f"{lc['compile_ms_median']:.1f} ms, max {lc['compile_ms_max']:.1f} ms over {lc['schemas']} schemas; a "
              f"cached grammar: {lc['hit_ms_median']:.3f} ms.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=["bullet", "chunked:256"])
    ap.add_argument("--requests", type=int, default=240, help="constrained requests per system (validity)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256, help="max_new_tokens of the validity requests")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens of each overhead request")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=4, help="overhead rounds per batch (kinds alternated)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--launch-flags", default="", help="more `bullet launch` flags for every system")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "structured")
    args = ap.parse_args(argv)
    model = ["--model-path", args.model_path] if args.model_path else []
    result = {"machine": machine(), "cpu_flags": cpu_flags(), "model": args.model_path or "SmolLM2-135M-Instruct",
              "command": "python artifact/benchmarks/bench_structured.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "systems": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for k, system in enumerate(args.systems):
        print(f"[structured] {system}: starting the server", flush=True)
        flags = [*model, *system_launch(system), "--max-running-requests", "32", *shlex.split(args.launch_flags)]
        with BulletServer(*flags) as server:
            entry = {"compile": served_compile(server, f"field_{k}_{int(time.time())}")}
            print(f"[structured] {system}: {args.requests} constrained requests, {args.concurrency} at a time", flush=True)
            entry["validity"] = validity(server, args.requests, args.concurrency, args.max_tokens)
            entry["overhead"] = []
            for b in args.batches:
                print(f"[structured] {system}: TPOT with and without a JSON schema at batch {b}", flush=True)
                entry["overhead"].append(overhead(server, b, args.tokens, args.rounds))
            tokenizer_dir = server.get("/model_info")[1]["tokenizer_path"]
        result["systems"][system] = entry
        (args.out / "structured.json").write_text(json.dumps(result, indent=2))  # a cap loses nothing measured
    result["local_compile"] = local_compile(tokenizer_dir)
    (args.out / "structured.json").write_text(json.dumps(result, indent=2))
    (args.out / "structured.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
