"""libsmctrl backend against a fake libsmctrl.so compiled here: the masks Bullet computes travel
through the real ctypes call (for H100, the unsigned __int128 argument) and are read back in C."""

from __future__ import annotations

import ctypes

import pytest

from bullet.partition import PartitionUnavailable, make_backend
from bullet.partition import cuda_driver
from bullet.partition.libsmctrl import LIBRARY_ENV
from bullet.partition.tpc_mask import enabled_tpcs

STREAM = 0x7F12_3456_7890  # a plausible user-space pointer: checks the handle arrives intact
A100_TPCS, H100_TPCS = 54, 66


class FakeLibSmCtrl:
    def __init__(self, path):
        self.path = str(path)
        self.lib = ctypes.CDLL(self.path)  # same handle as the backend's: shares the globals
        self.lib.fake_set_tpcs.argtypes = [ctypes.c_uint32]

    def set_tpcs(self, n: int) -> None:
        self.lib.fake_set_tpcs(n)

    def calls(self) -> int:
        return self.lib.fake_calls()

    def last_device(self) -> int:
        """The CUDA device index the backend last asked libsmctrl about (-1: never)."""
        return self.lib.fake_last_device()

    def last(self) -> tuple[str, int | None, int]:
        kind, stream = ctypes.c_int(), ctypes.c_void_p()
        low, high = ctypes.c_uint64(), ctypes.c_uint64()
        self.lib.fake_last(*(ctypes.byref(x) for x in (kind, stream, low, high)))
        name = {1: "stream", 2: "stream_ext", 3: "global"}[kind.value]
        return name, stream.value, low.value | (high.value << 64)


@pytest.fixture(scope="session")
def fake(build_c):
    return FakeLibSmCtrl(build_c("fake_libsmctrl.c", "libsmctrl_fake.so"))


@pytest.fixture(scope="session")
def fake_no_ext(build_c):
    return FakeLibSmCtrl(build_c("fake_libsmctrl.c", "libsmctrl_old.so", "-DNO_EXT"))


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    # the driver-version gate is tested on its own; elsewhere behave as on a driverless machine
    monkeypatch.setattr(cuda_driver, "cuda_driver_version", lambda: None)
    monkeypatch.delenv(LIBRARY_ENV, raising=False)


def backend(fake, role, tpcs, **opts):
    fake.set_tpcs(tpcs)
    opts.setdefault("stream", STREAM)
    return make_backend("libsmctrl", role, library=fake.path, **opts)


def expected_mask(tpcs: int, enabled: set[int]) -> int:
    """Written out bit by bit: set = disabled, for every bit the call carries."""
    width = 64 if tpcs <= 64 else 128
    return sum(1 << bit for bit in range(width) if bit not in enabled)


def test_a100_explicit_masks_use_the_64_bit_call(fake):
    b = backend(fake, "prefill", A100_TPCS)
    assert (b.total_units, b.granularity.minimum, b.granularity.step) == (108, 2, 2)
    b.apply(108)  # everything: only the 10 bits above TPC 53 stay set
    assert fake.last() == ("stream", STREAM, 0xFFC0_0000_0000_0000)
    b.apply(2)  # TPC 0 only
    assert fake.last() == ("stream", STREAM, 0xFFFF_FFFF_FFFF_FFFE)
    d = backend(fake, "decode", A100_TPCS)
    d.apply(2)  # TPC 53 only
    assert fake.last() == ("stream", STREAM, 0xFFFF_FFFF_FFFF_FFFF & ~(1 << 53))


def test_h100_needs_the_128_bit_call_and_its_halves_arrive_in_order(fake):
    d = backend(fake, "decode", H100_TPCS)
    d.apply(4)  # TPCs 64 and 65: both enabled bits live in the HIGH half
    kind, stream, mask = fake.last()
    assert (kind, stream) == ("stream_ext", STREAM)
    assert mask & ((1 << 64) - 1) == 0xFFFF_FFFF_FFFF_FFFF
    assert mask >> 64 == 0xFFFF_FFFF_FFFF_FFFC
    p = backend(fake, "prefill", H100_TPCS)
    p.apply(132)  # all 66 TPCs: low half all clear, high half keeps only bits >= 66 set
    assert fake.last()[2] == 0xFFFF_FFFF_FFFF_FFFC << 64


@pytest.mark.parametrize("tpcs", [A100_TPCS, H100_TPCS])
def test_every_split_sends_the_expected_mask_and_roles_stay_disjoint(fake, tpcs):
    total = 2 * tpcs
    prefill, decode = backend(fake, "prefill", tpcs), backend(fake, "decode", tpcs)
    for p_sms in range(2, total + 1, 2):
        prefill.apply(p_sms)
        p_mask = fake.last()[2]
        assert p_mask == expected_mask(tpcs, set(range(p_sms // 2)))
        d_sms = total - p_sms if p_sms < total else 2
        decode.apply(d_sms)
        d_mask = fake.last()[2]
        assert d_mask == expected_mask(tpcs, set(range(tpcs - d_sms // 2, tpcs)))
        on_p, on_d = set(enabled_tpcs(p_mask, tpcs)), set(enabled_tpcs(d_mask, tpcs))
        if p_sms + d_sms <= total:
            assert not on_p & on_d
        else:  # asked for more than the device: they share exactly the excess
            assert len(on_p & on_d) * 2 == p_sms + d_sms - total
        assert prefill.unit_set() == {s for t in on_p for s in (2 * t, 2 * t + 1)}
        assert decode.unit_set() == {s for t in on_d for s in (2 * t, 2 * t + 1)}


def test_odd_requests_round_up_to_whole_tpcs(fake):
    b = backend(fake, "decode", A100_TPCS)
    b.apply(29)
    assert b.current_units == 30
    assert b.unit_set() == set(range(78, 108))
    assert enabled_tpcs(fake.last()[2], A100_TPCS) == list(range(39, 54))
    with pytest.raises(ValueError):
        b.apply(0)


def test_stream_may_be_a_callable_resolved_at_each_apply(fake):
    handles = iter([0x1000, 0x2000])
    b = backend(fake, "prefill", A100_TPCS, stream=lambda: next(handles))
    b.apply(10)
    assert fake.last()[1] == 0x1000
    b.apply(12)
    assert fake.last()[1] == 0x2000


def test_global_scope_uses_the_global_call_and_refuses_more_than_64_tpcs(fake):
    b = backend(fake, "prefill", A100_TPCS, stream=None, scope="global")
    b.apply(4)
    assert fake.last() == ("global", None, expected_mask(A100_TPCS, {0, 1}))
    with pytest.raises(PartitionUnavailable, match="64-bit"):
        backend(fake, "prefill", H100_TPCS, stream=None, scope="global")


def test_apply_costs_are_recorded(fake):
    b = backend(fake, "prefill", A100_TPCS)
    before = fake.calls()
    for units in (2, 4, 6):
        b.apply(units)
    assert fake.calls() - before == 3
    costs = b.apply_costs()
    assert costs.count == 3 and 0 < costs.mean_us <= costs.max_us
    assert b.describe()["apply_cost"]["count"] == 3


def test_old_library_without_ext_call_works_up_to_64_tpcs_only(fake_no_ext):
    backend(fake_no_ext, "prefill", A100_TPCS).apply(8)
    assert fake_no_ext.last()[0] == "stream"
    with pytest.raises(PartitionUnavailable, match="libsmctrl_set_stream_mask_ext"):
        backend(fake_no_ext, "prefill", H100_TPCS)


def test_missing_library_names_the_env_var(tmp_path, monkeypatch):
    with pytest.raises(PartitionUnavailable, match=LIBRARY_ENV):
        make_backend("libsmctrl", "prefill", stream=STREAM)
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "nowhere.so"))
    with pytest.raises(PartitionUnavailable, match=f"nowhere.so \\(from {LIBRARY_ENV}\\) does not exist"):
        make_backend("libsmctrl", "prefill", stream=STREAM)


def test_library_from_env_var_and_stream_required(fake, monkeypatch):
    monkeypatch.setenv(LIBRARY_ENV, fake.path)
    fake.set_tpcs(A100_TPCS)
    assert make_backend("libsmctrl", "decode", stream=STREAM).total_units == 108
    with pytest.raises(PartitionUnavailable, match="stream handle is required"):
        make_backend("libsmctrl", "decode")


def test_drivers_newer_than_known_working_are_refused_unless_allowed(fake, monkeypatch):
    monkeypatch.setattr(cuda_driver, "cuda_driver_version", lambda: 12090)
    with pytest.raises(PartitionUnavailable, match="12.9 is newer"):
        backend(fake, "prefill", A100_TPCS)
    backend(fake, "prefill", A100_TPCS, allow_untested_driver=True).apply(2)
    monkeypatch.setenv("BULLET_LIBSMCTRL_ALLOW_UNTESTED", "1")  # a server's workers opt in through the environment
    backend(fake, "prefill", A100_TPCS).apply(2)
    monkeypatch.delenv("BULLET_LIBSMCTRL_ALLOW_UNTESTED")
    monkeypatch.setattr(cuda_driver, "cuda_driver_version", lambda: 12060)
    backend(fake, "prefill", A100_TPCS).apply(2)


# Which integer-argument register holds each ctypes slot after `stream`, per architecture.
ARG_REGISTERS = {"x86_64": ["%esi", "%edx", "%ecx"], "aarch64": ["x1", "x2", "x3"]}
COMPILERS = {"x86_64": "gcc", "aarch64": "aarch64-linux-gnu-gcc"}


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_int128_slot_table_matches_the_compilers_calling_convention(arch, tmp_path):
    """Compile a call passing low=0x1111, high=0x2222 as one unsigned __int128 and read from the
    assembly which argument register each half lands in; the ctypes slot table must agree."""
    import re
    import shutil
    import subprocess

    from bullet.partition.libsmctrl import _INT128_SLOTS

    compiler = shutil.which(COMPILERS[arch])
    if compiler is None or (arch == "x86_64" and subprocess.run(
            [compiler, "-dumpmachine"], capture_output=True, text=True).stdout.split("-")[0] != "x86_64"):
        pytest.skip(f"no {arch} C compiler here")
    src = tmp_path / "call.c"
    src.write_text("void ext(void *s, unsigned __int128 m);\n"
                   "void call(void *s) { ext(s, ((unsigned __int128)0x2222 << 64) | 0x1111); }\n")
    asm = subprocess.run([compiler, "-O2", "-S", str(src), "-o", "-"], capture_output=True, text=True,
                         check=True).stdout
    where = {}
    for value, half in ((4369, "low"), (8738, "high")):
        m = re.search(rf"mov\w*\s+\$?{value},\s*(\S+)|mov\w*\s+(\S+),\s*#?{value}\b", asm)
        assert m, asm
        where[half] = ARG_REGISTERS[arch].index(m.group(1) or m.group(2).rstrip(","))
    slots = _INT128_SLOTS[arch]
    assert slots.index("low") == where["low"] and slots.index("high") == where["high"]
