"""`FinishChecker.quiet_until`, which lets the simulator skip the finish rules for most tokens: below
the count it gives, `check` never ends a request whose every token is the given one — for every
combination of the rules (stop token ids, EOS, min/max new tokens, the model's context)."""

from __future__ import annotations

import itertools

from bullet.types.finish import FinishChecker
from bullet.types.request import Request
from engines.sampling_params import SamplingParams

TOKEN, EOS, OTHER = 0, 2, 7


def first_stop(checker: FinishChecker, req: Request, token: int, limit: int = 64) -> int | None:
    """Output tokens at which `check` first ends `req` when it samples `token` every step."""
    req.output_ids = []
    for n in range(1, limit + 1):
        req.output_ids.append(token)
        if checker.check(req) is not None:
            return n
    return None


def test_check_never_ends_a_request_before_quiet_until():
    cases = itertools.product([[], [TOKEN], [OTHER]], [False, True], [0, 3, 9], [1, 5, 12, 40], [20, 30, 200],
                              [{TOKEN}, {EOS}])
    seen = 0
    for stop_ids, ignore_eos, min_new, max_new, context, eos in cases:
        if min_new > max_new:
            continue
        params = SamplingParams(max_new_tokens=max_new, min_new_tokens=min_new, stop_token_ids=stop_ids,
                                ignore_eos=ignore_eos)
        checker = FinishChecker(None, eos, context)
        req = Request(rid="r", prompt_ids=[1] * 16, params=params)
        quiet = checker.quiet_until(req, TOKEN)
        stop = first_stop(checker, req, TOKEN)
        assert quiet >= 1
        assert stop is not None and quiet <= stop, (stop_ids, ignore_eos, min_new, max_new, context, eos)
        seen += quiet == stop  # tight where only lengths or the token decide
    assert seen > 100


def test_stop_strings_are_checked_on_every_token():
    class Tokens:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    params = SamplingParams(max_new_tokens=50, stop=["xxx"])
    req = Request(rid="r", prompt_ids=[1] * 4, params=params)
    assert FinishChecker(Tokens(), set(), 1000).quiet_until(req, TOKEN) == 1
    # without a tokenizer stop strings never match: only the lengths count
    assert FinishChecker(None, set(), 1000).quiet_until(req, TOKEN) == 50
