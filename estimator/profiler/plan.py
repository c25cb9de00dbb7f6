"""What `bullet profile` measures: a sparse set of execution states (Bullet §3.2.4), quick or full,
at CPU sizes (`ProfilePlan.quick`, `.full`) or GPU sizes (`gpu_plan`).

On every profiled share (every core count of a small CPU, a few SM shares of a GPU):
* kernel sweeps (`sweeps`): every kernel class of the model timed inside a real forward pass, for a
  few prefill lengths and decode batches — the op samples of the SRM calibration;
* end-to-end steps (`steps`): whole prefills (single prompts and packed batches), K-layer prefill
  steps as the layer-wise scheduler runs them, decode steps, and hybrid steps (a prompt chunk beside
  decode rows, as the chunked-prefill baselines run; on the largest share only, the one those
  baselines run on) — the phase samples of Eq. 2.
With the other phase running on the complementary share (`corun_*`): decode steps beside prefills
of a few lengths sl (-> D_{p,sl}), and prefill steps beside decode batches (-> prefill slowdown). On a
CPU of two or more cores, also the largest of those cases with both phases on every core (-> what a
core both workers' threads hold costs, `contention.shared_units`).
On one share (one core of a CPU, decode's largest share of a GPU), three decode steps tell whether decode
attention reads each request's own context or pads to the longest (`padding`: `padding_batch` requests up
to `padding_context` tokens).

The benchmark (`artifact/benchmarks/bench_estimator_cpu.py`) validates on states that are none of
these (`calibration_keys` lets it check)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from estimator.profiler.padding import padding_cases
from estimator.profiler.workload import DecodeCase, HybridCase, PrefillCase, uniform_decode

# A bigger model than the one the plan was sized for would make the largest steps take minutes:
# past this many seconds for one step, the larger steps of that kind are skipped.
MAX_STEP_SECONDS = {"quick": 1.5, "full": 5.0}


@dataclass(frozen=True)
class ProfilePlan:
    name: Literal["quick", "full"]
    sweeps: tuple[PrefillCase | DecodeCase, ...]
    steps: tuple[PrefillCase | DecodeCase | HybridCase, ...]
    corun_prefill_lengths: tuple[int, ...]  # sl of the prefill looping beside timed decode steps
    corun_decode_cases: tuple[DecodeCase, ...]
    corun_decode_batches: tuple[int, ...]  # decode batch looping beside timed prefill steps
    corun_decode_context: int
    corun_prefill_cases: tuple[PrefillCase, ...]
    repeats: int  # usable runs wanted per end-to-end step
    sweep_repeats: int  # kernel sweeps per state (median per kernel)
    budget_s: float  # time allowed for one step's runs on a busy machine
    quiet_wait_s: float  # longest pause before a measurement for other jobs to calm down
    padding_batch: int = 0  # the decode-padding probe's batch and longest context (0: not measured)
    padding_context: int = 0

    @property
    def max_step_seconds(self) -> float:
        return MAX_STEP_SECONDS[self.name]

    @classmethod
    def quick(cls) -> "ProfilePlan":
        """45-50 s on 2 cores with SmolLM2-135M as served (int8; model load and CPU probe included)."""
        return cls(
            name="quick",
            sweeps=(PrefillCase((32,)), PrefillCase((256,)), uniform_decode(1, 128), uniform_decode(16, 512),
                    uniform_decode(48, 64)),
            steps=(PrefillCase((32,)), PrefillCase((256,)), PrefillCase((64, 64)), PrefillCase((256,), 4),
                   uniform_decode(1, 128), uniform_decode(16, 512), uniform_decode(48, 64),
                   HybridCase((256,), uniform_decode(8, 512)), HybridCase((512,), uniform_decode(24, 512))),
            corun_prefill_lengths=(64, 512),
            corun_decode_cases=(uniform_decode(4, 256), uniform_decode(16, 512)),
            corun_decode_batches=(4, 32),
            corun_decode_context=256,
            corun_prefill_cases=(PrefillCase((128,)), PrefillCase((256,), 4)),
            repeats=3, sweep_repeats=2, budget_s=4.0, quiet_wait_s=1.0, padding_batch=16, padding_context=512,
        )

    @classmethod
    def full(cls) -> "ProfilePlan":
        """A few minutes: more lengths, batches and contexts, more repeats."""
        return cls(
            name="full",
            sweeps=(PrefillCase((16,)), PrefillCase((64,)), PrefillCase((256,)), PrefillCase((1024,)),
                    uniform_decode(1, 64), uniform_decode(1, 1024), uniform_decode(8, 256), uniform_decode(32, 128),
                    uniform_decode(32, 512), uniform_decode(64, 256)),
            steps=(PrefillCase((16,)), PrefillCase((64,)), PrefillCase((256,)), PrefillCase((1024,)),
                   PrefillCase((64,) * 4), PrefillCase((200, 50)), PrefillCase((64,), 4), PrefillCase((1024,), 4),
                   PrefillCase((256,), 1), uniform_decode(1, 64), uniform_decode(1, 1024), uniform_decode(8, 256),
                   uniform_decode(32, 128), uniform_decode(32, 512), uniform_decode(64, 256),
                   HybridCase((64,), uniform_decode(16, 256)), HybridCase((256,), uniform_decode(8, 512)),
                   HybridCase((512,), uniform_decode(24, 512))),
            corun_prefill_lengths=(32, 256, 1024),
            corun_decode_cases=(uniform_decode(1, 256), uniform_decode(8, 512), uniform_decode(32, 128)),
            corun_decode_batches=(1, 8, 32, 64),
            corun_decode_context=256,
            corun_prefill_cases=(PrefillCase((128,)), PrefillCase((512,)), PrefillCase((256,), 4)),
            repeats=5, sweep_repeats=3, budget_s=12.0, quiet_wait_s=3.0, padding_batch=16, padding_context=512,
        )

    @classmethod
    def named(cls, quick: bool) -> "ProfilePlan":
        return cls.quick() if quick else cls.full()

    def padding_cases(self) -> tuple[DecodeCase, ...]:
        """The decode-padding probe's steps (`padding.padding_cases`), or none."""
        return padding_cases(self.padding_batch, self.padding_context) if self.padding_batch else ()

    def all_cases(self) -> list[PrefillCase | DecodeCase]:
        corun_prefills = [PrefillCase((sl,)) for sl in self.corun_prefill_lengths]
        corun_decodes = [uniform_decode(b, self.corun_decode_context) for b in self.corun_decode_batches]
        return [*self.sweeps, *self.steps, *self.corun_decode_cases, *self.corun_prefill_cases, *corun_prefills,
                *corun_decodes, *self.padding_cases()]


def gpu_plan(quick: bool) -> ProfilePlan:
    """The same kinds of states at GPU sizes — prefills of hundreds to thousands of tokens, decode
    batches up to the serving limit — measured on a few SM shares (`shares.profiled_shares`) instead
    of every core count."""
    if quick:
        return ProfilePlan(
            name="quick",
            sweeps=(PrefillCase((512,)), PrefillCase((2048,)), uniform_decode(1, 1024), uniform_decode(32, 1024),
                    uniform_decode(128, 512)),
            steps=(PrefillCase((512,)), PrefillCase((2048,)), PrefillCase((512,) * 4), PrefillCase((2048,), 4),
                   uniform_decode(1, 1024), uniform_decode(8, 2048), uniform_decode(32, 1024),
                   uniform_decode(128, 512), HybridCase((2048,), uniform_decode(32, 1024)),
                   HybridCase((512,), uniform_decode(128, 512))),
            corun_prefill_lengths=(512, 2048),
            corun_decode_cases=(uniform_decode(32, 1024), uniform_decode(128, 512)),
            corun_decode_batches=(32, 128),
            corun_decode_context=1024,
            corun_prefill_cases=(PrefillCase((2048,)), PrefillCase((2048,), 4)),
            repeats=5, sweep_repeats=3, budget_s=10.0, quiet_wait_s=0.0, padding_batch=32, padding_context=2048,
        )
    return ProfilePlan(
        name="full",
        sweeps=(PrefillCase((128,)), PrefillCase((512,)), PrefillCase((2048,)), PrefillCase((8192,)),
                uniform_decode(1, 512), uniform_decode(1, 4096), uniform_decode(16, 1024), uniform_decode(64, 1024),
                uniform_decode(128, 2048), uniform_decode(256, 512)),
        steps=(PrefillCase((128,)), PrefillCase((512,)), PrefillCase((2048,)), PrefillCase((8192,)),
               PrefillCase((512,) * 4), PrefillCase((1500, 300, 200)), PrefillCase((2048,), 4),
               PrefillCase((8192,), 4), PrefillCase((2048,), 1), uniform_decode(1, 512), uniform_decode(1, 4096),
               uniform_decode(16, 1024), uniform_decode(64, 1024), uniform_decode(128, 2048),
               uniform_decode(256, 512), HybridCase((2048,), uniform_decode(32, 1024)),
               HybridCase((512,), uniform_decode(128, 512)), HybridCase((8192,), uniform_decode(64, 1024))),
        corun_prefill_lengths=(512, 2048, 8192),
        corun_decode_cases=(uniform_decode(8, 1024), uniform_decode(64, 1024), uniform_decode(256, 512)),
        corun_decode_batches=(8, 64, 256),
        corun_decode_context=1024,
        corun_prefill_cases=(PrefillCase((512,)), PrefillCase((2048,)), PrefillCase((2048,), 4)),
        repeats=10, sweep_repeats=5, budget_s=30.0, quiet_wait_s=0.0, padding_batch=64, padding_context=4096,
    )


def case_key(case: PrefillCase | DecodeCase | HybridCase) -> tuple:
    if isinstance(case, HybridCase):
        return ("hybrid", case.chunk_lens, tuple(sorted(case.decode.context_lens)))
    if isinstance(case, PrefillCase):
        return ("prefill", case.seq_lens, case.num_layers)
    return ("decode", tuple(sorted(case.context_lens)))


def calibration_keys(plan: ProfilePlan) -> set[tuple]:
    """Every state the plan measures (solo or co-running), as `case_key`s."""
    return {case_key(c) for c in plan.all_cases()}
