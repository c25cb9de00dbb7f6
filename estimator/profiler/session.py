"""One profiling session: the model loaded once, measurements turned into calibration samples.

* `step`: an end-to-end step (prefill or decode) on a core share -> a phase sample;
* `sweep`: the per-kernel times of a state -> op samples (one per kernel class);
* `beside_prefill` / `beside_decode`: a step timed while the other phase loops on the
  complementary cores (a spawned `CoRunner`) -> a phase sample with `co_running` set.
Each returns a `Measurement`: the samples and how many undisturbed runs they rest on.

Prefill steps run on the prefill role's share (lowest cores), decode steps on the decode role's
(highest), as the workers do. Before each measurement the session waits briefly for the machine to
be quiet (other jobs may share it)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engines.host import pin_all_threads
from engines.model_config import ModelConfig
from estimator.calibration import Sample
from estimator.profiler.corun import CoRunner
from estimator.profiler.kernel_timing import kernel_times, sweep_clock
from estimator.profiler.timing import Timing, time_calls, wait_until_quiet
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase, apply_share, kv_tokens_needed

TOKEN_CLASSES = ("input_norm", "qkv_proj", "rope", "o_proj", "post_attn_norm", "gate_up_proj", "act", "down_proj",
                 "residual_add")

Case = PrefillCase | DecodeCase


def phase_sample(case: Case, units: int, seconds: float, co_running: int = 0) -> Sample:
    if isinstance(case, PrefillCase):
        return Sample(kind="prefill", units=units, seconds=seconds, prefill_lens=case.seq_lens,
                      num_layers=case.num_layers, include_head=case.num_layers is None, co_running=co_running)
    return Sample(kind="decode", units=units, seconds=seconds, decode_batch=case.batch,
                  decode_context=case.total_context, co_running=co_running)


def op_samples(case: Case, units: int, times: dict[str, float]) -> list[Sample]:
    """One sample per kernel class from a sweep (`local_kernels.kernel_times`)."""
    decode = isinstance(case, DecodeCase)
    rows = case.batch if decode else case.tokens
    outputs = case.batch if decode else len(case.seq_lens)  # rows reaching the LM head
    samples = [Sample(kind=k, units=units, seconds=times[k], prefill_lens=(rows,)) for k in TOKEN_CLASSES]
    # The estimator's final norm covers every row of the step (SGLang's does); this engine's covers
    # only the rows reaching the LM head. Recorded against the step's rows, the sample calibrates
    # what the estimator asks about: the final norm's cost in a step of that many rows.
    samples += [Sample(kind="embedding", units=units, seconds=times["embedding"], prefill_lens=(rows,)),
                Sample(kind="final_norm", units=units, seconds=times["final_norm"], prefill_lens=(rows,)),
                Sample(kind="lm_head", units=units, seconds=times["lm_head"], prefill_lens=(outputs,))]
    if decode:
        samples.append(Sample(kind="attn_decode", units=units, seconds=times["attn_decode"],
                              decode_batch=case.batch, decode_context=case.total_context))
    else:
        samples.append(Sample(kind="attn_prefill", units=units, seconds=times["attn_prefill"],
                              prefill_lens=case.seq_lens))
    return [s for s in samples if s.seconds > 0]


@dataclass(frozen=True)
class Measurement:
    """What one measurement produced; `usable` = 0 means every run was disturbed (busy machine)
    and `seconds` is the least-disturbed estimate, not to be trusted."""

    label: str
    samples: list[Sample]
    seconds: float
    usable: int


def role_of(case: Case) -> str:
    return "prefill" if isinstance(case, PrefillCase) else "decode"


class ProfileSession:
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, cores: Sequence[int],
                 cases: Sequence[Case], budget_s: float = 10.0, quiet_wait_s: float = 2.0,
                 log: Callable[[str], None] = lambda _: None):
        self.config, self.state, self.dtype, self.cores = config, state, dtype, list(cores)
        self.budget_s, self.quiet_wait_s, self.log = budget_s, quiet_wait_s, log
        self.kv_tokens = kv_tokens_needed(cases)
        self.bench = ModelBench(config, state, self.kv_tokens, dtype)
        self._corunner: CoRunner | None = None
        # measuring re-pins every thread of this process; put them back on close, or every process
        # started from here afterwards (a test suite's next server) would inherit a one-core share
        self._original_cores, self._original_threads = os.sched_getaffinity(0), torch.get_num_threads()

    # ---- solo -------------------------------------------------------------------------------------

    def _prepare(self, case: Case, units: int, own_pids: tuple[int, ...] = ()) -> Callable[[], object]:
        apply_share(role_of(case), units, self.cores)
        fn = self.bench.step(case)
        wait_until_quiet(self.quiet_wait_s, own_pids=own_pids)
        return fn

    def step(self, case: Case, units: int, repeats: int) -> Measurement:
        timing = time_calls(self._prepare(case, units), repeats=repeats, budget_s=self.budget_s,
                            quiet_wait_s=self.quiet_wait_s)
        return self._done(f"{case.label()} on {units} core(s)", timing, [phase_sample(case, units, timing.seconds)])

    def sweep(self, case: Case, units: int, repeats: int) -> Measurement:
        """Per-kernel medians over the usable sweeps (a sweep = one forward, timed kernel by kernel)."""
        apply_share(role_of(case), units, self.cores)
        clock = sweep_clock(units)
        wait_until_quiet(self.quiet_wait_s)
        timing = time_calls(lambda: kernel_times(self.bench, case, clock)[0], repeats=repeats,
                            budget_s=self.budget_s, quiet_wait_s=self.quiet_wait_s)
        sweeps = timing.values
        times = {k: statistics.median(s[k] for s in sweeps) for k in sweeps[0]}
        return self._done(f"kernels of {case.label()} on {units} core(s)", timing, op_samples(case, units, times))

    def _done(self, label: str, timing: Timing, samples: list[Sample], extra: str = "") -> Measurement:
        self.log(f"{label}: {timing.seconds * 1e3:.1f} ms ({timing.usable} usable of {len(timing.runs)} runs){extra}")
        return Measurement(label, samples, timing.seconds, timing.usable)

    # ---- co-running -------------------------------------------------------------------------------

    def corunner(self) -> CoRunner:
        if self._corunner is None:
            self._corunner = CoRunner(self.config, self.state, self.dtype, self.kv_tokens, self.cores)
        return self._corunner

    def _beside(self, case: Case, units: int, other_role: str, other_case: Case, repeats: int) -> tuple[Timing, str]:
        """Time `case` on `units` cores while `other_case` loops on the other role's share of the
        remaining cores; also says how long the co-runner's steps took meanwhile."""
        other = self.corunner()
        other_units = len(self.cores) - units
        fn = self._prepare(case, units, own_pids=(other.pid,))
        with other.looping(other_role, other_units, other_case):
            start = time.perf_counter()
            timing = time_calls(fn, repeats=repeats, budget_s=self.budget_s, own_pids=(other.pid,),
                                quiet_wait_s=self.quiet_wait_s)
            end = time.perf_counter()
        inside = other.iterations_within(start, end)
        return timing, (f" ({other_case.label()} steps: {statistics.median(inside) * 1e3:.0f} ms)" if inside else "")

    def beside_prefill(self, case: DecodeCase, units: int, prefill_tokens: int, repeats: int) -> Measurement:
        """A decode step on `units` cores while a prefill of `prefill_tokens` loops on the rest."""
        timing, extra = self._beside(case, units, "prefill", PrefillCase((prefill_tokens,)), repeats)
        return self._done(f"{case.label()} on {units} core(s) beside prefill[{prefill_tokens}]", timing,
                          [phase_sample(case, units, timing.seconds, co_running=prefill_tokens)], extra)

    def beside_decode(self, case: PrefillCase, units: int, decode: DecodeCase, repeats: int) -> Measurement:
        """A prefill step on `units` cores while `decode` steps loop on the rest."""
        timing, extra = self._beside(case, units, "decode", decode, repeats)
        return self._done(f"{case.label()} on {units} core(s) beside {decode.label()}", timing,
                          [phase_sample(case, units, timing.seconds, co_running=decode.batch)], extra)

    def close(self) -> None:
        if self._corunner is not None:
            self._corunner.close()
            self._corunner = None
        pin_all_threads(set(self._original_cores))
        torch.set_num_threads(self._original_threads)

    def __enter__(self) -> "ProfileSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
