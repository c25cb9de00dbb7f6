"""Timing on a busy machine: when no run is usable, the least-disturbed runs are corrected for the
time our threads waited, but never below a positive share of the run (a delay summed over helper
threads can exceed the run itself; a negative time once failed a whole profile)."""

from estimator.profiler.timing import SINGLE_CORE_DELAY_LIMIT, Run, summarize


def test_a_correction_larger_than_the_run_leaves_a_positive_time():
    runs = [Run(wall=0.10, delay=0.12, foreign=1.0), Run(wall=0.10, delay=0.15, foreign=1.0)]
    timing = summarize(runs, [None, None], single_core=True)
    assert timing.usable == 0
    assert timing.seconds > 0
    assert timing.seconds >= 0.10 * (1 - SINGLE_CORE_DELAY_LIMIT)
