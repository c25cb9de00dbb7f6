"""The CPU kernels' own tests skip where an extension is not built (a source tree nobody installed).
On x86-64 Linux the install builds both (setup.py; a failed build fails the install), so there a
missing extension is an error here, not a row of skipped kernel tests that would pass unseen."""

from __future__ import annotations

import platform
import sys

import pytest

from engines.model import cpu_attention, cpu_gemv


def test_an_installed_x86_linux_tree_has_both_cpu_kernels_with_the_same_implementations():
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        pytest.skip(f"the build of the CPU kernels is only required on x86-64 Linux, not {sys.platform} "
                    f"{platform.machine()}")
    missing = [name for name, mod in (("engines._cpu_attention", cpu_attention), ("engines._cpu_gemv", cpu_gemv))
               if mod._ext is None]
    assert not missing, f"not built: {missing} (pip install -e . builds them)"
    # one header and one set of build macros: both run the same widest implementation on this CPU
    assert cpu_gemv._ext.best_isa() == cpu_attention._ext.best_isa()
    assert cpu_gemv.kernel_isa() == cpu_attention.kernel_isa()


def test_a_cpu_with_amx_gets_the_tile_kernel():
    """Where the CPU reports AMX-BF16 (and the process's kernel cap allows AVX-512), the installed build
    has the AMX experts (csrc/cpu_amx.c) and Linux granted this process the tiles: otherwise the tile
    tests would all skip, unseen, on exactly the CPUs they are for."""
    from engines.device import ISA_AVX512, cpu_has_amx

    if cpu_gemv._ext is None or not cpu_has_amx() or cpu_gemv.kernel_isa() != ISA_AVX512:
        pytest.skip("this CPU has no AMX-BF16 (or the kernel cap is below AVX-512)")
    assert cpu_gemv._ext.amx_ready(), ("the CPU has AMX but the kernel's tiles are not usable: built without the AMX "
                                       "targets (an old compiler) or the OS refused the tile state")
