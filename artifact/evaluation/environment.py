"""The environment record: what machine and software every number of a run came from. Speed numbers
mean nothing without the CPU, its vector flags (AVX-512, BF16, AMX decide the dtype and the kernels),
the cores the process may use, the torch build and the commit.

    python -m artifact.evaluation.environment --out DIR     # writes DIR/environment.{json,md}"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# flags that change which kernels and dtypes run; the full list is recorded as well
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
                 "amx_bf16", "amx_int8")
PACKAGES = ("torch", "numpy", "transformers", "sglang", "pydantic", "pyzmq", "matplotlib", "bullet-serve")


def cpu_info() -> dict:
    """Model name and flags of the first processor in /proc/cpuinfo (Linux); empty elsewhere."""
    model, flags = platform.processor() or "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("unknown", "", platform.processor()):
                model = value.strip()
            elif key == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    return {"model": model, "flags": flags, "notable_flags": [f for f in NOTABLE_FLAGS if f in flags]}


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_state() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line for line in git("status", "--porcelain").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD") or None, "branch": git("rev-parse", "--abbrev-ref", "HEAD") or None,
            "uncommitted_changes": len(changed)}


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def torch_info() -> dict:
    try:
        import torch

        from engines.device import resolve_dtype  # deferred: needs torch, which a broken install may lack
    except ImportError as exc:  # the record is still useful without torch
        return {"error": str(exc)}
    info = {"version": torch.__version__, "intra_op_threads": torch.get_num_threads(),
            "default_dtype_cpu": str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


def record() -> dict:
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"when_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "platform": platform.platform(),
            "python": platform.python_version(), "cpu": cpu_info(), "logical_cpus": os.cpu_count(),
            "usable_cores": affinity, "memory_gib": memory_gib(), "load_average": list(os.getloadavg()),
            "torch": torch_info(), "packages": versions(), "git": git_state(),
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "BULLET_"))}}


def markdown(env: dict) -> str:
    cpu, torch_, git = env["cpu"], env["torch"], env["git"]
    cores = env["usable_cores"]
    rows = [("when (UTC)", env["when_utc"]), ("CPU", cpu["model"]),
            ("notable CPU flags", ", ".join(cpu["notable_flags"]) or "none of " + ", ".join(NOTABLE_FLAGS)),
            ("cores usable / logical", f"{len(cores) if cores else '?'} ({cores}) / {env['logical_cpus']}"),
            ("memory", f"{env['memory_gib']} GiB"), ("load average at start", ", ".join(f"{x:.2f}" for x in env["load_average"])),
            ("platform", env["platform"]), ("python", env["python"]),
            ("torch", f"{torch_.get('version')} (threads {torch_.get('intra_op_threads')}, default CPU dtype "
                      f"{torch_.get('default_dtype_cpu')}, CUDA {'yes: ' + ', '.join(torch_['gpus']) if torch_.get('cuda_available') else 'no'})"),
            ("packages", ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)),
            ("commit", f"{git['commit']} ({git['branch']}; {git['uncommitted_changes']} uncommitted changes)"),
            ("OMP/MKL/BULLET environment", ", ".join(f"{k}={v}" for k, v in env["omp_env"].items()) or "none set")]
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += ["", f"All CPU flags: `{' '.join(cpu['flags'])}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = record()
    (args.out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    (args.out / "environment.md").write_text(markdown(env))
    print(markdown(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
