"""Build llama.cpp's `llama-server` from the `llama-cpp-python` source release (the sdist vendors a
pinned llama.cpp), once per machine: the binary is cached under ~/.cache/bullet/llamacpp/<version>/.

  python -m artifact.benchmarks.llamacpp_build [--version 0.3.36]

Steps: `pip download --no-binary :all: --no-deps llama-cpp-python==<version>` (the ordinary pip
client), unpack, `cmake -DGGML_NATIVE=ON` (the flags of *this* CPU: AVX2 here, AVX512 where present),
build only the `llama-server` target. A build takes ~10-20 minutes on 2 cores."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_VERSION = "0.3.36"
CACHE = Path(os.environ.get("BULLET_CACHE_DIR", Path.home() / ".cache" / "bullet")) / "llamacpp"


def server_binary(version: str = DEFAULT_VERSION) -> Path:
    return CACHE / version / "llama-server"


def _run(cmd: list[str], cwd: Path | None = None, log: Path | None = None) -> None:
    print("[llamacpp] " + " ".join(cmd), flush=True)
    with open(log, "a") if log else open(os.devnull, "w") as out:
        proc = subprocess.run(cmd, cwd=cwd, stdout=out if log else None, stderr=subprocess.STDOUT if log else None)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode})" + (f": see {log}" if log else ""))


def build(version: str = DEFAULT_VERSION, jobs: int | None = None) -> Path:
    """The cached llama-server binary, built first if absent."""
    binary = server_binary(version)
    if binary.exists():
        return binary
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
            tar.extractall(work, filter="data")
    source = root / "vendor" / "llama.cpp"
    build_dir = work / "build"
    _run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], log=log)
    _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)], log=log)
    built = next((p for p in (build_dir / "bin" / "llama-server", build_dir / "tools" / "server" / "llama-server")
                  if p.exists()), None)
    if built is None:
        raise RuntimeError(f"the build finished but no llama-server binary was found under {build_dir}")
    shutil.copy2(built, binary)
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args()
    print(build(args.version, args.jobs))


if __name__ == "__main__":
    main()
