"""The device run's libsmctrl build step: its dry run, a real compile of a small stand-in source with
the same build recipe (cc + cuda.h + a libcuda to link against, a stub where no driver is), the
fetch script copying a local source, and — where a fetched libsmctrl source is present — the real
library compiled here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from artifact.gpu_check import libsmctrl
from artifact.gpu_check.plan import MECHANISM
from artifact.gpu_check.steps import Context
from bullet.partition.gpu_helper import find_cuda_include
from bullet.partition.libsmctrl import LIBRARY_ENV

ROOT = Path(__file__).resolve().parents[2]
HAVE_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
can_build = pytest.mark.skipif(not HAVE_CC or find_cuda_include() is None,
                               reason="needs a C compiler and the CUDA toolkit's cuda.h")

# Not libsmctrl: a few lines with its entry points' names, calling the driver like it does, so that the
# recipe (include path, link against libcuda, exports) is exercised without its source.
STAND_IN_C = r"""
#include <cuda.h>
#include <stdint.h>
#include "libsmctrl.h"
int libsmctrl_get_tpc_info_cuda(uint32_t *num_tpcs, int dev) {
    int sms = 0;
    CUresult rc = cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    *num_tpcs = (uint32_t)sms / 2;
    return (int)rc;
}
void libsmctrl_set_stream_mask(void *stream, uint64_t mask) { (void)stream; (void)mask; }
void libsmctrl_set_stream_mask_ext(void *stream, unsigned __int128 mask) { (void)stream; (void)mask; }
void libsmctrl_set_global_mask(uint64_t mask) { (void)mask; }
"""
STAND_IN_H = ("/**\n * Copyright 2026 Stand In\n */\n#include <stdint.h>\n"
              "void libsmctrl_set_global_mask(uint64_t mask);\n")


def stand_in(folder: Path, licence: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "libsmctrl.c").write_text(STAND_IN_C)
    (folder / "libsmctrl.h").write_text(STAND_IN_H)
    if licence:
        (folder / "LICENSE").write_text("\nStand-in licence, for the test only\n")
    return folder


def test_the_dry_run_names_the_missing_source_and_the_command_that_fetches_it(tmp_path):
    work = libsmctrl.plan(tmp_path / "absent", tmp_path / "out")
    assert any(libsmctrl.FETCH_COMMAND in p for p in work["problems"])
    assert work["library"] == str(tmp_path / "out" / "libsmctrl.so")
    assert any("libsmctrl.c -shared -fPIC" in c and "-ldl" in c for c in work["commands"])
    done = subprocess.run([sys.executable, "-m", "artifact.gpu_check.libsmctrl", "--dry-run", "--source",
                           str(tmp_path / "absent")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and libsmctrl.FETCH_COMMAND in done.stdout


def test_the_dry_run_of_a_present_source_has_no_problems_and_states_its_licence(tmp_path):
    work = libsmctrl.plan(stand_in(tmp_path / "src"), tmp_path / "out")
    if not HAVE_CC or find_cuda_include() is None:
        pytest.skip("no C compiler or cuda.h: the plan names that instead")
    assert work["problems"] == []
    assert work["licence"]["files"] == ["LICENSE"]
    assert work["licence"]["first_line"] == "Stand-in licence, for the test only"
    assert work["licence"]["copyright"] == ["Copyright 2026 Stand In"]
    assert "no licence file" in libsmctrl.licence(stand_in(tmp_path / "bare", licence=False))["note"]


@can_build
def test_the_recipe_really_compiles_and_links_libcuda_by_its_soname(tmp_path):
    work = libsmctrl.build(stand_in(tmp_path / "src"), tmp_path / "out")
    lib = Path(work["library"])
    assert lib.is_file() and all(work["exports"].values()), work["exports"]
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
        assert "[libcuda.so.1]" in dynamic  # the driver answers at run time, whatever it was linked against


@can_build
def test_a_compile_error_is_reported_with_the_compilers_message(tmp_path):
    src = stand_in(tmp_path / "src")
    (src / "libsmctrl.c").write_text("this is not C;\n")
    with pytest.raises(libsmctrl.BuildError, match="libsmctrl.c"):
        libsmctrl.build(src, tmp_path / "out")


def _ctx(tmp_path: Path, env: dict) -> Context:
    return Context(root=tmp_path, plan=MECHANISM, work=tmp_path / "work", wheel_dir=tmp_path / "wheels", env=env)


def test_the_step_without_a_carried_source_is_skipped_with_the_reason(tmp_path):
    ctx = _ctx(tmp_path, {})
    out = libsmctrl.build_step(ctx, 60)
    assert out["status"] == "skipped" and libsmctrl.FETCH_COMMAND in out["summary"]
    assert LIBRARY_ENV not in ctx.env


@can_build
def test_the_step_builds_and_hands_the_library_to_the_steps_after_it(tmp_path):
    stand_in(tmp_path / ".gpu-sources" / "libsmctrl")
    (tmp_path / ".gpu-sources" / "libsmctrl.source").write_text("libsmctrl /somewhere commit abc123")
    ctx = _ctx(tmp_path, {})
    out = libsmctrl.build_step(ctx, 120)
    assert out["status"] == "pass", out
    assert ctx.env[LIBRARY_ENV] == str(tmp_path / "work" / "libsmctrl" / "libsmctrl.so")
    assert "commit abc123" in out["summary"] and "with the 128-bit" in out["summary"]


def test_the_fetch_script_copies_a_local_source_and_stamps_it(tmp_path):
    src = stand_in(tmp_path / "checkout")
    dest = tmp_path / "sources"
    env = {**os.environ, "LIBSMCTRL_SOURCE": str(src), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_sources.sh"), str(dest)], capture_output=True,
                          text=True, env=env, timeout=120)
    if done.returncode != 0 and (not HAVE_CC or find_cuda_include() is None):
        pytest.skip("the script's closing dry run needs cc and cuda.h")
    assert done.returncode == 0, done.stderr
    assert (dest / "libsmctrl" / "libsmctrl.c").read_text() == STAND_IN_C
    assert (dest / "libsmctrl.source").read_text().startswith(f"libsmctrl {src} commit ")


def test_the_carried_sources_are_ignored_by_git():
    assert "/.gpu-sources/" in (ROOT / ".gitignore").read_text().splitlines()


@can_build
def test_the_fetched_libsmctrl_compiles_here():
    source = libsmctrl.source_dir()
    if libsmctrl.missing_files(source):
        pytest.skip(f"no libsmctrl source at {source} (fetch it with `{libsmctrl.FETCH_COMMAND}`)")
    work = libsmctrl.build(source, ROOT / "build" / "libsmctrl-test")
    assert work["exports"]["libsmctrl_set_stream_mask"] and work["exports"]["libsmctrl_get_tpc_info_cuda"]
