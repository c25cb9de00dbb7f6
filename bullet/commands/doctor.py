"""`bullet doctor`: can this machine run Bullet's two workers as designed?"""

from __future__ import annotations

from bullet.doctor.all_checks import DoctorOptions, run_checks
from bullet.doctor.results import exit_code, render_json, render_text

NAME = "doctor"
HELP = "check this machine (shared memory, cores, cpu partitioning; on a GPU: MPS, SM masks, green contexts, IPC)"
DESCRIPTION = """\
Checks this machine and prints PASS/FAIL/SKIP per check; exits non-zero if any check FAILs.

Any machine: Python/torch versions, /dev/shm writable with enough free space, leftover
/dev/shm/bullet-* segments (listed, not removed), core count, and that the cpu partition backend
really restricts every thread of a child process (read back from /proc).

NVIDIA GPU: CUDA device, MPS daemon (two processes only run kernels concurrently under MPS), driver
version against libsmctrl's known-working range (CUDA <= 12.8), libsmctrl masks and green-context
pool streams checked with an %smid probe kernel (built with nvcc) — directly and inside CUDA graph
replays; the verdicts are recorded and decide whether decode runs as CUDA graphs under each backend —,
a worker's steps running on its partitioned stream across a repartition, decode graph replays
matching the eager step, the profiler's CUDA-event timing seeing a share's SMs, CUDA IPC
zero-copy sharing with a spawned child, and — last — cross-process isolation by timing: for each
backend that loads (green-ctx, libsmctrl when given, mps-percentage), two processes on opposite
halves of the SMs loop a GEMM alone and together; disjoint shares keep >= 90 % of their alone rate.
Its verdicts are recorded per GPU, driver and MPS on/off and pick `--partition-backend auto`.

Every report carries the GPU model, driver, MPS state and date it was measured on (`--json`:
"measured_on"); run it once with MPS off and once with it on.

The GPU checks are written against official APIs (torch.cuda, the CUDA driver API, the MPS control
daemon); on a machine without a GPU they report SKIP with the reason. Run `bullet doctor` on the
target GPU before trusting the GPU path."""


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every check's details")
    parser.add_argument("--libsmctrl", metavar="PATH", default=None,
                        help="libsmctrl.so to check (default: $BULLET_LIBSMCTRL)")
    parser.add_argument("--allow-untested-driver", action="store_true",
                        help="check libsmctrl masks even on a driver newer than its known-working range")
    parser.add_argument("--min-shm-mb", type=int, default=512, help="free /dev/shm space required (MiB)")
    parser.add_argument("--no-isolation", action="store_true",
                        help="skip the cross-process timing check (it starts two processes per GPU backend)")


def run(args) -> int:
    opts = DoctorOptions(min_shm_mb=args.min_shm_mb, libsmctrl=args.libsmctrl,
                         allow_untested_driver=args.allow_untested_driver, isolation=not args.no_isolation)
    results, context = run_checks(opts)
    if args.json:
        print(render_json(results, context))
    else:
        print(f"bullet doctor {context['bullet']} on {context['host']}")
        on = context["measured_on"]
        print(f"GPU {on['gpu'] or '-'}, driver {on['driver']}, MPS {on['mps']}, {on['date']}")
        if context["gpu"] != "available":
            print(f"GPU checks: {context['gpu']} — {context['gpu_checks_note']}")
        print(render_text(results, verbose=args.verbose))
    return exit_code(results)
