"""Does a decode step's attention pay for each request's own context, or for the batch's longest?

The estimator prices a decode step's attention from the KV tokens it reads (`Estimator.decode_reads`):
the summed context when each request reads its own pages, batch x the longest context when the engine
pads every row to the longest (`HardwareSpec.decode_attention_padded`). Which one holds is a property of
the engine on this device, so `bullet profile` measures it instead of declaring it: three decode steps
of one batch size on one share —

* *ragged*: contexts spread evenly from a quarter of `context` up to `context`;
* *mean*: every request at the ragged batch's mean context (the same summed context);
* *longest*: every request at `context` (what a padded engine reads for the ragged batch);

— and the ragged step is called padded when it sits nearer the longest than the mean. Where the three
hardly differ (attention is a small part of the step), the flag changes no prediction that matters and
the summed context is kept. Each step is measured in three rounds, in turn: a 2-core machine's speed drifts
by more than a step's context changes it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from estimator.profiler.workload import DecodeCase, uniform_decode

TOO_CLOSE = 0.10  # longest within 10 % of mean: context barely changes the step (or noise hides it)
ROUNDS = 3  # each step measured this many times, in turn


def padding_cases(batch: int, context: int) -> tuple[DecodeCase, DecodeCase, DecodeCase]:
    """(ragged, mean, longest) decode cases of `batch` requests up to `context` tokens."""
    if batch < 2 or context < 8:
        raise ValueError(f"a padding probe needs at least 2 requests and 8 tokens of context, got {batch} x {context}")
    low = context // 4
    ragged = tuple(low + round(i * (context - low) / (batch - 1)) for i in range(batch))
    return DecodeCase(ragged), uniform_decode(batch, round(sum(ragged) / batch)), uniform_decode(batch, context)


@dataclass(frozen=True)
class PaddingVerdict:
    padded: bool | None  # None: not measured (the hardware description's own value stands)
    note: str  # what was measured and concluded, for the profile's notes and the log


NOT_MEASURED = PaddingVerdict(None, "decode padding not measured (every run disturbed): priced by summed context")


def decide_padding(ragged_s: float, mean_s: float, longest_s: float, label: str = "") -> PaddingVerdict:
    """Padded when the ragged step costs more than halfway from the mean-context step to the
    longest-context one."""
    times = f"ragged {ragged_s * 1e3:.2f} ms, mean context {mean_s * 1e3:.2f} ms, longest {longest_s * 1e3:.2f} ms"
    what = f"decode attention{f' ({label})' if label else ''}: {times}"
    spread = longest_s - mean_s
    if spread <= TOO_CLOSE * mean_s:
        return PaddingVerdict(False, f"{what} — context hardly changes the step: priced by summed context")
    share = (ragged_s - mean_s) / spread
    if share > 0.5:
        return PaddingVerdict(True, f"{what} — the ragged step pays {share:.0%} of the way to the longest: "
                                    "priced as padded to the longest context")
    return PaddingVerdict(False, f"{what} — the ragged step pays {max(share, 0.0):.0%} of the way to the longest: "
                                 "each request reads its own context (priced by summed context)")


def measure_padding(session, units: int, repeats: int, batch: int, context: int,
                    rounds: int = ROUNDS) -> tuple[PaddingVerdict, list]:
    """The verdict from the three steps timed by `session` (a `session.MeasuringSession`) on `units`
    of decode's share, each the median of `rounds` measurements taken in turn, the order reversed every
    other round (a machine whose speed drifts then slows no one step more than the others); `NOT_MEASURED`
    when one step's runs were all disturbed (nothing to conclude from). With it, the calibration samples of
    the two uniform steps (decode steps like any other; the ragged one is left out: what it reads is
    what was in question)."""
    cases = padding_cases(batch, context)
    seconds: list[list[float]] = [[], [], []]
    uniform = []
    for r in range(rounds):
        for i in (range(3) if r % 2 == 0 else range(2, -1, -1)):
            measured = session.step(cases[i], units, repeats)
            if measured.usable:
                seconds[i].append(measured.seconds)
                if i:
                    uniform += measured.samples
    if not all(seconds):
        return NOT_MEASURED, uniform
    ragged, mean, longest = (statistics.median(s) for s in seconds)
    return decide_padding(ragged, mean, longest, f"{cases[0].label()} on {units} {session.timer.unit_name}, "
                                                 f"medians of {rounds} rounds"), uniform
