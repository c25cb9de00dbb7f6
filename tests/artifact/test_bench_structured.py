"""The structured-output benchmark's own parts, without a server: at least ten JSON schemas, and every
constraint it sends compiles with xgrammar; its validity check (jsonschema, Python's re — not the
library that constrained the output) accepts a right answer and refuses a wrong one of each kind."""

from __future__ import annotations

import json

import pytest

from artifact.benchmarks.bench_structured import GRAMMARS, LONG_LIST, REGEXES, SCHEMAS, cases, valid

pytest.importorskip("jsonschema")


def test_every_constraint_compiles():
    xgr = pytest.importorskip("xgrammar")
    assert len(SCHEMAS) >= 10 and len(cases()) == len(SCHEMAS) + len(REGEXES) + len(GRAMMARS)
    for kind, name, prompt, constraint in cases():
        assert name.replace("_", " ") in prompt
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(json.dumps(constraint))
        elif kind == "regex":
            xgr.Grammar.from_regex(constraint)
        else:
            xgr.Grammar.from_ebnf(constraint)
    xgr.Grammar.from_json_schema(json.dumps(LONG_LIST))


@pytest.mark.parametrize("kind, name, good, bad", [
    ("json_schema", "person", '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": -1}'),
    ("json_schema", "product", '{"sku": "ABC-1234", "title": "Pen", "price": 1.5, "in_stock": true}',
     '{"sku": "abc-1234", "title": "Pen", "price": 1.5, "in_stock": true}'),
    ("json_schema", "weather", '{"city": "Oslo", "temperature_c": -3, "condition": "snow"}', '{"city": "Oslo"'),
    ("regex", "iso_date", "2024-02-29", "2024-13-01"),
    ("regex", "ipv4", "192.168.0.1", "256.1.1.1"),
    ("ebnf", "arithmetic", "12 + 7 * 3", "12 +"),
    ("ebnf", "key_values", "a=1;bc=22", "a=1;"),
])
def test_validity_check_is_independent_and_strict(kind, name, good, bad):
    assert valid(kind, name, good) == (True, "")
    ok, why = valid(kind, name, bad)
    assert not ok and why
