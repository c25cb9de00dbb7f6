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
