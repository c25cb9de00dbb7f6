"""Build libsmctrl on the GPU machine from source carried with the checkout.

libsmctrl (Bakita & Anderson, RTAS'23: TPC masks on CUDA streams) is not on PyPI and is not part of
this repository: its source is build input, fetched on a machine with internet by
`bash scripts/gpu_sources.sh` into `.gpu-sources/libsmctrl/` (ignored by git, carried to the GPU
machine beside `.gpu-wheels/`; `$BULLET_LIBSMCTRL_SOURCE` names another folder). Its licence is the
one in the fetched copy: this step records the licence file (or its absence) and the copyright lines
of `libsmctrl.h` in its result, and the project redistributes nothing of it.

The build is the library's own single-file recipe — `cc libsmctrl.c -shared -fPIC ... -lcuda -ldl` —
with cuda.h from the CUDA toolkit and a libcuda to link against: the toolkit's stub
(`lib64/stubs/libcuda.so`), else the driver's `libcuda.so.1`, else a stub made here (an empty library
whose soname is `libcuda.so.1`: the link only records that name, and the real driver answers at run
time — so the library builds on a machine without a GPU). The result's path is what the libsmctrl
partition backend reads from `$BULLET_LIBSMCTRL` (`bullet.partition.libsmctrl`); the step puts it in
the run's environment for the steps after it.

    python -m artifact.gpu_check.libsmctrl --dry-run            # what would be built, and with what
    python -m artifact.gpu_check.libsmctrl --out build/libsmctrl  # build it; prints the library's path"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bullet.partition.gpu_helper import find_cuda_include
from bullet.partition.libsmctrl import LIBRARY_ENV

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ENV = "BULLET_LIBSMCTRL_SOURCE"
DEFAULT_SOURCE = ROOT / ".gpu-sources" / "libsmctrl"
SOURCE_STAMP_SUFFIX = ".source"  # .gpu-sources/libsmctrl.source: where and which commit it came from
UPSTREAM = "https://github.com/JoshuaJB/libsmctrl"
FETCH_COMMAND = "bash scripts/gpu_sources.sh"
REQUIRED = ("libsmctrl.c", "libsmctrl.h")
EXPORTS = ("libsmctrl_get_tpc_info_cuda", "libsmctrl_set_stream_mask", "libsmctrl_set_global_mask",
           "libsmctrl_set_stream_mask_ext")


class BuildError(RuntimeError):
    pass


def source_dir(given: str | os.PathLike | None = None, root: Path = ROOT) -> Path:
    """Where the source is looked for: `given`, else $BULLET_LIBSMCTRL_SOURCE, else .gpu-sources/libsmctrl."""
    if given:
        return Path(given)
    if os.environ.get(SOURCE_ENV):
        return Path(os.environ[SOURCE_ENV])
    return root / ".gpu-sources" / "libsmctrl"


def missing_files(source: Path) -> list[str]:
    return [name for name in REQUIRED if not (source / name).is_file()]


def licence(source: Path) -> dict:
    """The licence file the fetched copy carries (name and first line) and libsmctrl.h's copyright
    lines: what the report states about it."""
    files = sorted(p for p in source.glob("*") if re.match(r"(?i)(licen[cs]e|copying)", p.name) and p.is_file())
    out: dict = {"files": [p.name for p in files]}
    if files:
        first = next((l.strip() for l in files[0].read_text(errors="replace").splitlines() if l.strip()), "")
        out["first_line"] = first[:200]
    header = source / "libsmctrl.h"
    if header.is_file():
        out["copyright"] = [l.strip(" */") for l in header.read_text(errors="replace").splitlines()[:20]
                            if "copyright" in l.lower()]
    if not files:
        out["note"] = "no licence file in the fetched copy: check the upstream's terms before redistributing anything"
    return out


def stamp(source: Path) -> str | None:
    path = source.with_name(source.name + SOURCE_STAMP_SUFFIX)
    return path.read_text().strip() if path.is_file() else None


def _cuda_roots() -> list[Path]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return [Path(r) for r in roots if r]


def find_libcuda() -> tuple[list[str], str] | None:
    """Linker arguments for libcuda and where they point: the toolkit's stub, else the driver's
    library (ldconfig); None when neither is there."""
    for root in _cuda_roots():
        for stubs in (root / "lib64" / "stubs", *sorted(root.glob("targets/*/lib/stubs"))):
            if (stubs / "libcuda.so").is_file():
                return ["-L", str(stubs), "-lcuda"], f"toolkit stub {stubs / 'libcuda.so'}"
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for line in listing.splitlines():
        if line.strip().startswith("libcuda.so.1 ") and "=>" in line:
            path = Path(line.split("=>", 1)[1].strip())
            return ["-L", str(path.parent), "-l:libcuda.so.1"], f"driver library {path}"
    return None


def stub_command(cc: str, out_dir: Path) -> list[str]:
    """An empty libcuda whose soname is libcuda.so.1 (built where no toolkit stub or driver is)."""
    return [cc, "-shared", "-fPIC", "-x", "c", "/dev/null", "-Wl,-soname,libcuda.so.1",
            "-o", str(out_dir / "stub" / "libcuda.so")]


def plan(source: Path, out_dir: Path, cc: str | None = None) -> dict:
    """The build, worked out but not run: source, licence, compiler, cuda.h, libcuda, commands. Its
    "problems" say what stops a real build."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    include = find_cuda_include()
    problems = []
    gone = missing_files(source)
    if not source.is_dir():
        problems.append(f"no libsmctrl source at {source}: run `{FETCH_COMMAND}` on a machine with internet "
                        f"(or set {SOURCE_ENV} to a copy)")
    elif gone:
        problems.append(f"{source} lacks {', '.join(gone)}")
    if cc is None:
        problems.append("no C compiler (cc/gcc, or $CC)")
    if include is None:
        problems.append("cuda.h not found (install the CUDA toolkit or set CUDA_HOME)")
    found = find_libcuda()
    commands = []
    if found is None:
        link, libcuda = ["-L", str(out_dir / "stub"), "-lcuda"], f"a stub made here ({out_dir / 'stub' / 'libcuda.so'})"
        if cc:
            commands.append(stub_command(cc, out_dir))
    else:
        link, libcuda = found
    out = out_dir / "libsmctrl.so"
    commands.append([cc or "cc", str(source / "libsmctrl.c"), "-shared", "-fPIC", "-O2", "-Wall", "-Wno-parentheses",
                     f"-I{source}", f"-I{include or '<cuda.h not found>'}", "-o", str(out),
                     # kept even where the stub defines nothing: the library must name libcuda.so.1
                     "-Wl,--no-as-needed", *link, "-ldl"])
    return {"source": str(source), "source_stamp": stamp(source) if source.is_dir() else None,
            "licence": licence(source) if source.is_dir() else None, "compiler": cc,
            "cuda_include": str(include) if include else None, "libcuda": libcuda, "library": str(out),
            "commands": [" ".join(c) for c in commands], "argv": commands, "problems": problems}


def exported(library: Path) -> dict[str, bool]:
    """Which of the entry points Bullet binds the built library exports (nm -D; no CUDA loaded)."""
    try:
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    return {name: name in names for name in EXPORTS}


def build(source: Path, out_dir: Path, cc: str | None = None, timeout: float = 120.0) -> dict:
    """Run the plan; raises BuildError with the compiler's message. The plan, plus "exports"."""
    work = plan(source, out_dir, cc)
    if work["problems"]:
        raise BuildError("; ".join(work["problems"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    for cmd in work["argv"]:
        if cmd[-1].endswith("stub/libcuda.so"):
            Path(cmd[-1]).parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    work["exports"] = exported(Path(work["library"]))
    missing = [name for name, present in work["exports"].items() if not present and name != EXPORTS[-1]]
    if missing:
        raise BuildError(f"{work['library']} does not export {', '.join(missing)}")
    return work


def build_step(ctx, timeout: float) -> dict:
    """The device run's step: build libsmctrl into <work>/libsmctrl/ and hand its path to the steps
    after it ($BULLET_LIBSMCTRL in the run's environment). Skipped when no source was carried."""
    # deferred: steps imports the plan, and a plan that names this step imports this module
    from artifact.gpu_check import steps

    source = source_dir(ctx.env.get(SOURCE_ENV), ctx.root)
    work = plan(source, ctx.work / "libsmctrl")
    if not source.is_dir():
        return steps.result("skipped", work["problems"][0], **_public(work))
    try:
        work = build(source, ctx.work / "libsmctrl", timeout=max(10.0, timeout - 5.0))
    except (BuildError, subprocess.TimeoutExpired) as e:
        return steps.result("fail", str(e)[:600], **_public(work))
    ctx.env[LIBRARY_ENV] = work["library"]
    ext = "with" if work["exports"].get(EXPORTS[-1]) else "without"
    origin = work["source_stamp"] or str(source)
    return steps.result("pass", f"{work['library']} built from {origin} ({ext} the 128-bit stream mask call), "
                                f"linked against {work['libcuda']}", **_public(work))


def _public(work: dict) -> dict:
    return {k: v for k, v in work.items() if k != "argv"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--source", help=f"the libsmctrl source folder (default: ${SOURCE_ENV}, else {DEFAULT_SOURCE})")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "libsmctrl", help="where libsmctrl.so goes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, build nothing")
    args = parser.parse_args(argv)
    source = source_dir(args.source)
    if args.dry_run:
        work = plan(source, args.out)
        print(json.dumps(_public(work), indent=2))
        return 0 if not work["problems"] else 2
    try:
        work = build(source, args.out)
    except BuildError as e:
        print(f"libsmctrl: {e}", file=sys.stderr)
        return 1
    print(json.dumps(_public(work), indent=2), file=sys.stderr)
    print(work["library"])
    print(f"use it: export {LIBRARY_ENV}={work['library']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
