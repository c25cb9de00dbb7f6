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


def test_a_short_disturbed_run_is_repeated_at_once_and_a_long_one_waits_for_a_quiet_moment(monkeypatch):
    """Looking for a quiet moment costs a window of the machine's counters: a run shorter than that
    window is repeated after a pause of its own length; a longer one waits (here: a machine busy
    throughout, so it waits its whole allowance)."""
    from estimator.profiler import timing

    looks, pauses = [], []
    monkeypatch.setattr(timing, "others_busy", lambda window, own_pids=(): looks.append(window) or 1.0)
    monkeypatch.setattr(timing.time, "sleep", pauses.append)
    timing._after_disturbed_run(0.002, left_s=1.0, quiet_wait_s=1.0, own_pids=())
    assert looks == [] and pauses == [0.002]
    pauses.clear()
    timing._after_disturbed_run(0.5, left_s=1.0, quiet_wait_s=0.3, own_pids=())
    assert len(looks) == 3 and set(looks) == {timing.QUIET_WINDOW_S} and pauses == []
    looks.clear()
    timing._after_disturbed_run(0.5, left_s=0.0, quiet_wait_s=0.3, own_pids=())  # the budget is spent
    assert looks == [] and pauses == [timing._BACKOFF_S]


def test_a_measurement_right_after_an_undisturbed_one_skips_the_look_for_a_quiet_moment(monkeypatch):
    from estimator.profiler import session
    from estimator.profiler.timing import Timing

    looks = []
    monkeypatch.setattr(session, "wait_until_quiet", lambda seconds, own_pids=(): looks.append(seconds) or 0.0)
    timer = session.CpuTimer(budget_s=1.0, quiet_wait_s=0.5)
    timer.settle(())
    assert looks == [0.5]  # nothing measured yet: it looks
    clean, busy = Run(wall=0.01, delay=0.0, foreign=0.0), Run(wall=0.01, delay=0.0, foreign=1.0)
    timer._seen(Timing(0.01, (clean, clean), usable=2))
    timer.settle(())
    assert looks == [0.5]  # the machine was quiet throughout the last measurement
    timer._seen(Timing(0.01, (clean, busy), usable=1))
    timer.settle(())
    assert looks == [0.5, 0.5]


def test_the_profile_progress_bar_runs_no_thread_beside_the_timed_one(capsys):
    """rich's refresh thread woke 10 times a second and took the interpreter's lock from the thread being
    timed: the bar is redrawn when a measurement ends instead."""
    import threading

    from estimator.profiler.sweep import _progress_bar

    before = {t.ident for t in threading.enumerate()}
    with _progress_bar(True, 2) as (advance, log):
        advance("first")
        assert {t.ident for t in threading.enumerate()} == before
        advance("second")
    assert "2/2" in capsys.readouterr().out
