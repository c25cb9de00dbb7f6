"""Build llama.cpp's `llama-server` (and its `llama-perplexity` tool) from the `llama-cpp-python`
source release (the sdist vendors a pinned llama.cpp), once per machine: the binaries are cached under
~/.cache/bullet/llamacpp/<version>/.

  python -m artifact.benchmarks.llamacpp_build [--version 0.3.36] [--isa native|avx2]
                                               [--tools llama-server llama-perplexity]

Steps: `pip download --no-binary :all: --no-deps llama-cpp-python==<version>` (the ordinary pip
client), unpack, `cmake -DGGML_NATIVE=ON` (the flags of *this* CPU: AVX2 here, AVX512 where present),
build only the requested targets (`llama-server` by default). A build takes ~10-20 minutes on 2 cores.

`--isa avx2` builds a second binary (`llama-server-avx2`) with `-DGGML_NATIVE=OFF` and ggml's x86
defaults (AVX, AVX2, BMI2, FMA, F16C; no AVX-512): the kernels an AVX2-only machine runs."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_VERSION = "0.3.36"
ISAS = ("native", "avx2")
TOOLS = ("llama-server", "llama-perplexity")
CACHE = Path(os.environ.get("BULLET_CACHE_DIR", Path.home() / ".cache" / "bullet")) / "llamacpp"


def safe_extract(tar: tarfile.TarFile, into: Path) -> None:
    """Extract `tar` under `into`, refusing what could reach outside it: tarfile's "data" filter where
    this Python has it (3.11.4 / 3.10.12 on), the same checks by hand before."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, filter="data")
        return
    root = Path(into).resolve()
    for member in tar.getmembers():
        target = (root / member.name).resolve()
        if member.issym():  # a symbolic link's target is relative to its own folder
            linked = ((root / member.name).parent / member.linkname).resolve()
        else:
            linked = (root / member.linkname).resolve() if member.islnk() else target
        if member.isdev() or not (target.is_relative_to(root) and linked.is_relative_to(root)):
            raise RuntimeError(f"{member.name}: a device or a path outside {into} in {tar.name}: not extracted")
    tar.extractall(into)


def server_binary(version: str = DEFAULT_VERSION, isa: str = "native", tool: str = "llama-server") -> Path:
    return CACHE / version / (tool if isa == "native" else f"{tool}-{isa}")


def _run(cmd: list[str], cwd: Path | None = None, log: Path | None = None) -> None:
    print("[llamacpp] " + " ".join(cmd), flush=True)
    with open(log, "a") if log else open(os.devnull, "w") as out:
        proc = subprocess.run(cmd, cwd=cwd, stdout=out if log else None, stderr=subprocess.STDOUT if log else None)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode})" + (f": see {log}" if log else ""))


def build(version: str = DEFAULT_VERSION, jobs: int | None = None, isa: str = "native",
          tool: str = "llama-server") -> Path:
    """The cached binary of `tool` for `isa`, built first if absent."""
    return build_tools(version, jobs, isa, (tool,))[tool]


def build_tools(version: str = DEFAULT_VERSION, jobs: int | None = None, isa: str = "native",
                tools: tuple[str, ...] = ("llama-server",)) -> dict[str, Path]:
    """tool -> its cached binary for `isa`; the missing ones are built in one cmake invocation."""
    if isa not in ISAS:
        raise ValueError(f"unknown isa {isa!r}; choose one of {', '.join(ISAS)}")
    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise ValueError(f"unknown tool(s) {sorted(unknown)}; choose from {', '.join(TOOLS)}")
    binaries = {tool: server_binary(version, isa, tool) for tool in tools}
    missing = [tool for tool, path in binaries.items() if not path.exists()]
    if not missing:
        return binaries
    work = CACHE / version / "src"
    work.mkdir(parents=True, exist_ok=True)
    log = CACHE / version / "build.log"
    sdist = next(work.glob(f"llama_cpp_python-{version}.tar.gz"), None)
    if sdist is None:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={version}", "-d", str(work)], log=log)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    root = work / sdist.name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(sdist) as tar:
            safe_extract(tar, work)
    source = root / "vendor" / "llama.cpp"
    build_dir = work / ("build" if isa == "native" else f"build-{isa}")
    isa_flags = (["-DGGML_NATIVE=ON"] if isa == "native"
                 else ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF"])
    _run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", *isa_flags,
          "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], log=log)
    _run(["cmake", "--build", str(build_dir), "--target", *missing, "-j", str(jobs or os.cpu_count() or 1)], log=log)
    for tool in missing:
        built = next((p for p in (build_dir / "bin" / tool, build_dir / "tools" / tool.removeprefix("llama-") / tool)
                      if p.exists()), None)
        if built is None:
            raise RuntimeError(f"the build finished but no {tool} binary was found under {build_dir}")
        shutil.copy2(built, binaries[tool])
    return binaries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--isa", choices=ISAS, default="native", help="native: this CPU's flags; avx2: no AVX-512")
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=["llama-server"])
    args = ap.parse_args()
    for tool, path in build_tools(args.version, args.jobs, args.isa, tuple(args.tools)).items():
        print(f"{tool}: {path}")


if __name__ == "__main__":
    main()
