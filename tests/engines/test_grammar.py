"""Constrained decoding without a model: a toy vocabulary, random logits, and the grammar's bitmask
doing all the work. The matcher hand-over between the two workers runs as it does in the server —
prefill samples the first token, the request crosses as a typed JSON `Handoff` (no pickle), and the
decode side, with its own compiled-grammar cache, rebuilds the matcher from the tokens emitted so far."""

from __future__ import annotations

import json
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from bullet.types.finish import Abort, FinishChecker, Length, Stop  # noqa: E402
from bullet.types.messages import Handoff, Recompute, decode, encode  # noqa: E402
from bullet.types.request import Request  # noqa: E402
from bullet.workers.outbox import request_from_handoff, request_from_recompute  # noqa: E402
from bullet.workers.sampling import sample_next  # noqa: E402
from engines.grammar import GrammarError, Grammars, check  # noqa: E402
from engines.sampler import SampleRow, sample, unpack_bitmask  # noqa: E402
from engines.sampling_params import SamplingParams  # noqa: E402

# a toy vocabulary: single characters, a few multi-character pieces, and an end-of-sequence token
VOCAB = list("abcdefghijklmnopqrstuvwxyz0123456789 ,.{}[]\":") + ["yes", "no", "ab", "12", "</s>"]
EOS = len(VOCAB) - 1
WIDTH = len(VOCAB) + 3  # the model's logits may be wider than the tokenizer's vocabulary


def toy_grammars() -> Grammars:
    return Grammars(lambda: xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=WIDTH, stop_token_ids=[EOS]))


def text(ids: list[int]) -> str:
    return "".join(VOCAB[t] for t in ids if t != EOS)


FINISH = FinishChecker(None, {EOS}, max_context=10_000)


def step(reqs: list[Request], grammars: Grammars, gen: torch.Generator) -> None:
    """One sampling step on random logits (where a real step's would come from the model)."""
    sample_next(torch.randn(len(reqs), WIDTH, generator=gen) * 5, reqs, FINISH, grammars)


def run_to_end(req: Request, grammars: Grammars, gen: torch.Generator, limit: int = 200) -> None:
    for _ in range(limit):
        if req.finished:
            return
        step([req], grammars, gen)


def handoff(req: Request) -> Request:
    """The request as the decode worker receives it: through the wire format, from its output ids."""
    msg = Handoff(rid=req.rid, uid=req.uid, prompt_ids=req.prompt_ids, output_ids=req.output_ids, page_table=[1],
                  params=req.params, arrival=req.arrival, first_token_time=req.first_token_time)
    received = decode(encode(msg))
    assert isinstance(received, Handoff) and received.params.constraint == req.params.constraint
    return request_from_handoff(received)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefill_first_token_then_decode_follow_one_grammar(temperature):
    pattern = r"(yes|no), [0-9]{2,4}\."
    prefill, decode_side, gen = toy_grammars(), toy_grammars(), torch.Generator().manual_seed(7)
    for trial in range(6):
        req = Request(rid=f"r{trial}", prompt_ids=[1, 2, 3],
                      params=SamplingParams(regex=pattern, temperature=temperature, max_new_tokens=64, seed=trial))
        step([req], prefill, gen)  # prefill: the first token
        assert len(req.output_ids) == 1 and req.grammar is not None
        moved = handoff(req)
        assert moved.grammar is None  # nothing of the matcher travels: decode rebuilds it
        run_to_end(moved, decode_side, gen)
        assert isinstance(moved.finish_reason, Stop) and moved.output_ids[-1] == EOS
        assert re.fullmatch(pattern, text(moved.output_ids)), text(moved.output_ids)
    # each side compiled the grammar once, for every request
    assert prefill.compiled_count == 1 and decode_side.compiled_count == 1


def test_recompute_rebuilds_the_matcher_from_every_token_so_far():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammars, gen = toy_grammars(), torch.Generator().manual_seed(3)
    req = Request(rid="r", prompt_ids=[5], params=SamplingParams(json_schema=json.dumps(schema), max_new_tokens=40,
                                                                 temperature=1.0))
    for _ in range(4):
        step([req], grammars, gen)
    msg = decode(encode(Recompute(rid=req.rid, uid=req.uid, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
                                  params=req.params, arrival=req.arrival, first_token_time=0.0)))
    again = request_from_recompute(msg)
    run_to_end(again, toy_grammars(), gen)
    if isinstance(again.finish_reason, Stop):
        assert isinstance(json.loads(text(again.output_ids))["a"], int)
    else:
        assert isinstance(again.finish_reason, Length)


def test_end_of_sequence_only_where_the_grammar_may_end():
    grammars = toy_grammars()
    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(regex="abc", temperature=0))
    logits = torch.full((1, WIDTH), -5.0)
    logits[0, EOS] = 10.0  # the model wants to stop at once: the grammar says "abc" first
    for _ in range(10):
        if req.finished:
            break
        sample_next(logits.clone(), [req], FINISH, grammars)
    assert text(req.output_ids) == "abc" and req.output_ids[-1] == EOS
    assert req.finish_reason == Stop(matched=EOS)


def test_grammar_wins_over_min_new_tokens_and_ends_with_ignore_eos():
    grammars = toy_grammars()
    gen = torch.Generator().manual_seed(0)
    # min_new_tokens bans EOS, but after "ab" the grammar allows nothing else: the ban is lifted
    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(regex="ab", min_new_tokens=10, max_new_tokens=20))
    run_to_end(req, grammars, gen)
    assert text(req.output_ids) == "ab" and req.finish_reason == Stop(matched=EOS)
    # ignore_eos: a grammar that has ended stops the request all the same
    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(regex="ab", ignore_eos=True, max_new_tokens=20))
    run_to_end(req, grammars, gen)
    assert text(req.output_ids) == "ab" and req.finish_reason == Stop(matched=EOS)


def test_max_new_tokens_mid_grammar_is_length():
    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(regex="[a-z]{20}", max_new_tokens=5))
    run_to_end(req, toy_grammars(), torch.Generator().manual_seed(1))
    assert req.finish_reason == Length(length=5) and re.fullmatch("[a-z]+", text(req.output_ids))


def test_a_forged_handoff_that_breaks_the_grammar_fails_that_request_only():
    grammars, gen = toy_grammars(), torch.Generator().manual_seed(2)
    bad = Request(rid="bad", prompt_ids=[1], params=SamplingParams(regex="[0-9]+"), output_ids=[0])  # "a"
    good = Request(rid="good", prompt_ids=[1], params=SamplingParams(regex="[0-9]+", max_new_tokens=3))
    free = Request(rid="free", prompt_ids=[1], params=SamplingParams(max_new_tokens=3))
    step([bad, good, free], grammars, gen)
    assert isinstance(bad.finish_reason, Abort) and "does not fit the grammar" in bad.finish_reason.message
    assert bad.output_ids == [0] and len(good.output_ids) == 1 and len(free.output_ids) == 1
    assert re.fullmatch("[0-9]+", text(good.output_ids))


def test_a_grammar_that_does_not_compile_fails_its_request_with_the_reason():
    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(regex="(a"))
    step([req], toy_grammars(), torch.Generator())
    assert isinstance(req.finish_reason, Abort) and "parenthesis" in req.finish_reason.message
    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(regex="a"))
    step([req], None, torch.Generator())  # a worker without a tokenizer
    assert isinstance(req.finish_reason, Abort) and "tokenizer" in req.finish_reason.message


def test_check_names_the_problem_in_xgrammars_words():
    check("regex", "[0-9]+")
    check("json_schema", '{"type": "object"}')
    check("ebnf", 'root ::= "a" | "b"')
    check("structural_tag", json.dumps({"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}))
    for kind, bad, words in [("regex", "[a-", "Unclosed"), ("json_schema", '{"type": "foo"}', "foo"),
                             ("json_schema", "{nope", "JSON"), ("ebnf", "root ::= other", "other"),
                             ("structural_tag", "[1]", "object")]:
        with pytest.raises(GrammarError, match=words) as info:
            check(kind, bad)
        assert ".cc:" not in str(info.value)  # no C++ source location


def test_the_cache_compiles_each_grammar_once_and_stays_bounded():
    grammars = Grammars(toy_grammars()._make_info, capacity=3)
    for i in range(6):
        grammars.compiled(("regex", f"a{{{i + 1}}}"))
    grammars.compiled(("regex", "a{6}"))
    assert grammars.compiled_count == 6 and len(grammars) <= 3


def test_sampler_masks_and_logit_bias():
    logits = torch.zeros(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 1] = 1 << 3  # token 35 only
    mask[1, 0] = (1 << 4) | (1 << 7)  # tokens 4 and 7
    assert unpack_bitmask(mask, 40)[1].nonzero().flatten().tolist() == [4, 7]
    biased = SamplingParams(temperature=0, logit_bias={"7": 5.0})
    res = sample(logits, [SampleRow(SamplingParams(temperature=0), allowed=mask[0]), SampleRow(biased, allowed=mask[1])])
    assert res.token_ids == [35, 7]
    # the bias alone, and -100 as a ban
    res = sample(torch.zeros(1, 5), [SampleRow(SamplingParams(temperature=0, logit_bias={0: -100, 3: 2}))])
    assert res.token_ids == [3]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 500})
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", json_schema="{}")


@pytest.mark.parametrize("rows, vocab, words", [(1, 40, 2), (16, 49152, 1536), (3, 100, 3), (2, 100, 2)])
def test_xgrammars_mask_kernel_equals_the_unpacked_bits(rows, vocab, words):
    """The packed mask applied by xgrammar's CPU kernel (what sampling uses for float32 CPU logits) and
    by unpacking the bits with torch (every other case) give the same logits, also for a mask narrower
    than the logits (the extra tokens are disallowed) and a vocabulary not a multiple of 32."""
    from engines.grammar import apply_bitmask

    g = torch.Generator().manual_seed(rows * vocab)
    packed = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    logits = torch.randn(rows, vocab, generator=g)
    expected = logits.masked_fill(~unpack_bitmask(packed, vocab), float("-inf"))
    assert torch.equal(apply_bitmask(logits.clone(), packed), expected)
    # through the sampler: greedy picks the best allowed token of each row, on both paths
    best = expected.argmax(dim=-1).tolist()
    for dtype in (torch.float32, torch.float64):
        res = sample(logits.to(dtype), [SampleRow(SamplingParams(temperature=0), allowed=packed[i]) for i in range(rows)])
        assert res.token_ids == best
        # some rows constrained, the others free: the masked rows are gathered and written back
        mixed = [SampleRow(SamplingParams(temperature=0), allowed=packed[i] if i % 2 else None) for i in range(rows)]
        free = logits.argmax(dim=-1).tolist()
        assert sample(logits.to(dtype), mixed).token_ids == [best[i] if i % 2 else free[i] for i in range(rows)]


@pytest.mark.parametrize("schema, where", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "/uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "integer"}}}}, "/properties/a/not"),
    ({"anyOf": [{"type": "object", "dependentRequired": {"a": ["b"]}}]}, "/anyOf/0/dependentRequired"),
    ({"type": "array", "items": {"if": {"type": "integer"}, "then": {"minimum": 10}}}, "/items/if"),
])
def test_keywords_xgrammar_does_not_enforce_are_refused(schema, where):
    """xgrammar compiles these keywords but lets output break them (checked with each one): such a
    schema is a GrammarError naming the keyword and where it is, never output that may break it."""
    with pytest.raises(GrammarError, match="does not enforce") as err:
        check("json_schema", json.dumps(schema))
    assert where in str(err.value)


def test_keyword_names_used_as_property_names_are_fine():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"},
                                               "uniqueItems": {"type": "boolean"}},
              "$defs": {"then": {"type": "string"}}, "items": {"uniqueItems": False}}
    check("json_schema", json.dumps(schema))


def test_json_whitespace_is_bounded():
    """A JSON output may not grow by whitespace alone (a small model otherwise writes newlines until its
    token limit): at most JSON_MAX_WHITESPACE characters of it in one place, any JSON still allowed."""
    from xgrammar.testing import _is_grammar_accept_string

    from engines.grammar import JSON_MAX_WHITESPACE, parse

    grammar = parse("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"]}))
    assert _is_grammar_accept_string(grammar, '{\n  "a": 1\n}')
    assert _is_grammar_accept_string(grammar, "{" + " " * JSON_MAX_WHITESPACE + '"a": 1}')
    assert not _is_grammar_accept_string(grammar, "{" + "\n" * (JSON_MAX_WHITESPACE + 1) + '"a": 1}')
