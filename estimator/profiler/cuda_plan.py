"""What `bullet profile` measures on a GPU: the same kinds of states as on the CPU (`plan.ProfilePlan`)
at GPU sizes — prefills of hundreds to thousands of tokens, decode batches up to the serving limit —
on a few SM shares (`cuda_shares.profiled_shares`) instead of every core count."""

from __future__ import annotations

from estimator.profiler.plan import ProfilePlan
from estimator.profiler.workload import PrefillCase, uniform_decode


def gpu_plan(quick: bool) -> ProfilePlan:
    if quick:
        return ProfilePlan(
            name="quick",
            sweeps=(PrefillCase((512,)), PrefillCase((2048,)), uniform_decode(1, 1024), uniform_decode(32, 1024),
                    uniform_decode(128, 512)),
            steps=(PrefillCase((512,)), PrefillCase((2048,)), PrefillCase((512,) * 4), PrefillCase((2048,), 4),
                   uniform_decode(1, 1024), uniform_decode(8, 2048), uniform_decode(32, 1024),
                   uniform_decode(128, 512)),
            corun_prefill_lengths=(512, 2048),
            corun_decode_cases=(uniform_decode(32, 1024), uniform_decode(128, 512)),
            corun_decode_batches=(32, 128),
            corun_decode_context=1024,
            corun_prefill_cases=(PrefillCase((2048,)), PrefillCase((2048,), 4)),
            repeats=5, sweep_repeats=3, budget_s=10.0, quiet_wait_s=0.0,
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
               uniform_decode(256, 512)),
        corun_prefill_lengths=(512, 2048, 8192),
        corun_decode_cases=(uniform_decode(8, 1024), uniform_decode(64, 1024), uniform_decode(256, 512)),
        corun_decode_batches=(8, 64, 256),
        corun_decode_context=1024,
        corun_prefill_cases=(PrefillCase((512,)), PrefillCase((2048,)), PrefillCase((2048,), 4)),
        repeats=10, sweep_repeats=5, budget_s=30.0, quiet_wait_s=0.0,
    )
