"""csrc/gpu_partition.c: builds with gcc against the toolkit's cuda.h and no driver; on this machine
it reports "no CUDA driver" without crashing; against a fake libcuda.so (compiled here) the whole
green-context path — symbol resolution by CUDA version, cuInit, one split, descriptors, green
contexts, streams, teardown — runs through the real helper and ctypes binding.

Everything that touches the helper at run time happens in a child process: the helper reads
BULLET_LIBCUDA once per process, and a crash would show as an exit code, not a dead test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bullet.partition import cuda_driver
from bullet.partition.gpu_helper import build_helper, find_cuda_include

RUN = r"""
import ctypes, json, sys
from bullet.partition import PartitionUnavailable, make_backend
from bullet.partition.gpu_helper import GpuPartitionHelper, DriverCallFailed
helper_path, fake_path, roles = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
h = GpuPartitionHelper(helper_path)
out = {}
try:
    out["driver_version"] = h.driver_version()
except DriverCallFailed as e:
    out["driver_version_error"] = [e.code, str(e)]
try:
    h.load()
    out["device_info"] = h.device_info(0)
except DriverCallFailed as e:
    out["load_error"] = [e.code, str(e)]
fake = ctypes.CDLL(fake_path) if fake_path else None
for role in roles:
    try:
        b = make_backend("green-ctx", role, driver=h)
    except PartitionUnavailable as e:
        out[role] = {"error": str(e)}
        continue
    buf = (ctypes.c_uint * 256)()
    pools = {}
    for sms, stream in b.pool_streams().items():
        fake.fake_stream_sms.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint]
        n = fake.fake_stream_sms(stream, buf, 256)
        pools[sms] = list(buf[:n])
    b.apply(20)
    out[role] = {"pools": pools, "feasible": b.feasible_units(), "current": b.current_units,
                 "unit_set": sorted(b.unit_set()), "live_before_close": fake.fake_live_streams()}
    b.close()
if fake:
    out["live_after"] = [fake.fake_live_green(), fake.fake_live_streams()]
print(json.dumps(out))
"""


@pytest.fixture(scope="session")
def cuda_include():
    include = find_cuda_include()
    if include is None:
        pytest.skip("cuda.h not found (no CUDA toolkit or nvidia-cuda-runtime wheel): cannot build the helper")
    return include


@pytest.fixture(scope="session")
def helper(c_build_dir, cuda_include):
    return build_helper(out_dir=c_build_dir / "helper", include_dir=cuda_include)


def run_helper(helper, fake=None, roles=("prefill", "decode"), **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "BULLET_LIBCUDA"}
    if fake:
        environ["BULLET_LIBCUDA"] = str(fake)
    environ.update(env)
    done = subprocess.run([sys.executable, "-c", RUN, str(helper), str(fake or ""), ",".join(roles)],
                          capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_helper_builds_once_per_source_hash(helper, c_build_dir, cuda_include):
    assert helper.is_file()
    stamp = helper.stat().st_mtime_ns
    assert build_helper(out_dir=c_build_dir / "helper", include_dir=cuda_include) == helper
    assert helper.stat().st_mtime_ns == stamp


@pytest.mark.skipif(cuda_driver.cuda_driver_version() is not None, reason="a CUDA driver is installed here")
def test_no_driver_is_reported_cleanly(helper):
    out = run_helper(helper, roles=("prefill",))
    code, message = out["load_error"]
    assert code == -1 and message.startswith("no CUDA driver: cannot load libcuda.so.1")
    assert out["driver_version_error"][0] == -1
    assert out["prefill"]["error"].startswith("green-ctx unavailable: no CUDA driver")


@pytest.fixture(scope="session")
def fake_cuda(build_c, cuda_include):
    def build(*flags):
        name = "libcuda_fake" + "".join(f.lower().replace("-d", "_") for f in flags) + ".so"
        return build_c("fake_libcuda.c", name, f"-I{cuda_include}", *flags)
    return build


def test_green_context_pool_through_the_helper(helper, fake_cuda):
    out = run_helper(helper, fake_cuda(), FAKE_CUDA_SMS="132", FAKE_CUDA_MIN="8", FAKE_CUDA_ALIGN="8")
    assert out["driver_version"] == 12080 and out["device_info"] == [132, [9, 0]]
    prefill, decode = out["prefill"], out["decode"]
    # prefill: the first groups and the 4-SM remainder; decode: the last groups (the remainder only in
    # its "all" entry) — so prefill 4 + 8k beside decode 8(16 - k) is the whole device
    assert prefill["feasible"] == list(range(12, 133, 8)) and decode["feasible"] == list(range(8, 129, 8)) + [132]
    for sms, ids in prefill["pools"].items():
        assert ids == list(range(int(sms) - 4)) + list(range(128, 132))
    for sms, ids in decode["pools"].items():
        assert ids == (list(range(128 - int(sms), 128)) if int(sms) < 132 else list(range(132)))
    for sms in prefill["pools"]:
        beside = 132 - int(sms)
        if beside:
            assert not set(prefill["pools"][sms]) & set(decode["pools"][str(beside)])
    assert prefill["current"] == 20 and prefill["unit_set"] == list(range(16)) + list(range(128, 132))
    assert decode["live_before_close"] == 17  # one stream per pool entry (16 + full)
    assert out["live_after"] == [0, 0]  # close destroyed every stream and green context


def test_cuda_12_4_driver_takes_the_context_route_to_a_stream(helper, fake_cuda):
    out = run_helper(helper, fake_cuda("-DNO_GREEN_STREAM"), roles=("decode",),
                     FAKE_CUDA_SMS="108", FAKE_CUDA_MIN="4", FAKE_CUDA_ALIGN="2")
    pools = out["decode"]["pools"]
    assert sorted(map(int, pools)) == list(range(4, 109, 4))  # groups raised to the 4-SM minimum
    assert pools["12"] == list(range(96, 108))
    assert out["live_after"] == [0, 0]


def test_driver_without_green_contexts_names_what_is_missing(helper, fake_cuda):
    out = run_helper(helper, fake_cuda("-DNO_GREEN"), roles=("prefill",), FAKE_CUDA_VERSION="12030")
    assert out["driver_version"] == 12030 and "load_error" not in out
    assert "lacks cu" in out["prefill"]["error"] and "12.4 or newer" in out["prefill"]["error"]


def test_driver_errors_are_named_and_a_failed_pool_leaks_nothing(helper, fake_cuda):
    out = run_helper(helper, fake_cuda(), roles=("prefill",), FAKE_CUDA_MAX_GREEN="3")
    assert "cuGreenCtxCreate failed: CUDA_ERROR_OUT_OF_MEMORY" in out["prefill"]["error"]
    assert out["live_after"] == [0, 0]
