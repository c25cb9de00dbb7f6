"""Every policy's workers start on a CUDA device given as a user gives it — `"cuda"`, `"cuda:0"`,
`torch.device("cuda", 0)` — through the launcher's own path, on a machine without a GPU.

The first GPU run crashed at worker start-up under every policy: the device reached the workers as
the string "cuda", and `"cuda".index` is the str method. Here the real `Launcher` resolves the
device, loads a tiny dummy model, creates the shared segments and builds each worker's spec;
`build_worker` then wires each worker exactly as a worker process does. CUDA is the fake of
`fake_cuda.py` (tensors stay on the CPU), green contexts its recording driver, libsmctrl the fake
library compiled from `fake_libsmctrl.c` — each records the device it was handed, which must be
device index 0 of a `torch.device`, everywhere."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from bullet.config import ServerArgs
from bullet.launcher.launcher import Launcher
from bullet.partition import cuda_driver
from bullet.partition.graph_policy import EAGER, PER_SHARE, SHARED
from bullet.partition.libsmctrl import LIBRARY_ENV
from bullet.types.roles import Role
from bullet.workers.wiring import build_worker
from estimator.reference.profiles import SHIPPED_PROFILE
from tests.partition.fake_cuda import GPU, FakeCuda
from tests.partition.test_libsmctrl import FakeLibSmCtrl
from tests.partition.tiny_model import CONFIG
from tests.server_utils import bullet_segments

DEVICES = ["cuda", "cuda:0", torch.device("cuda", 0)]
# (policy, backend): each policy with the backends it is served with on a GPU
POLICIES = [("bullet", "auto"), ("bullet", "green-ctx"), ("bullet", "libsmctrl"), ("static", "green-ctx"),
            ("static", "libsmctrl"), ("naive", "none"), ("chunked:64", "none"), ("sglang:64", "none")]
# what `auto` resolves to here: no doctor verdict on this (fake) GPU, so green contexts, said to be unproven
RESOLVED = {"auto": "green-ctx"}
DECODE_GRAPHS = {"none": SHARED, "green-ctx": PER_SHARE, "libsmctrl": EAGER}  # no doctor record here


@pytest.fixture(scope="module")
def smctrl(build_c):
    lib = FakeLibSmCtrl(build_c("fake_libsmctrl.c", "libsmctrl_devices_test.so"))
    lib.set_tpcs(66)  # an H100: 132 SMs
    return lib


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": CONFIG.hidden_size,
                                "intermediate_size": CONFIG.intermediate_size,
                                "num_hidden_layers": CONFIG.num_hidden_layers,
                                "num_attention_heads": CONFIG.num_attention_heads,
                                "num_key_value_heads": CONFIG.num_key_value_heads, "head_dim": CONFIG.head_dim,
                                "vocab_size": CONFIG.vocab_size, "max_position_embeddings": 512}))
    return path


@pytest.fixture
def gpu_env(monkeypatch, tmp_path, smctrl):
    monkeypatch.setattr(cuda_driver, "cuda_driver_version", lambda: None)  # no driver: libsmctrl's gate passes
    monkeypatch.setenv(LIBRARY_ENV, smctrl.path)
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path / "cache"))  # no graph-replay record from this machine
    monkeypatch.delenv("BULLET_DECODE_GRAPHS", raising=False)


def server_args(device, policy: str, backend: str, config_path) -> ServerArgs:
    return ServerArgs(device=device, policy=policy, partition_backend=backend, load_format="dummy",
                      model_path=str(config_path), max_total_tokens=256, page_size=4, max_running_requests=8,
                      estimator_profile=str(SHIPPED_PROFILE) if policy == "bullet" else None)


def start_workers_as_the_launcher_does(args: ServerArgs, cuda: FakeCuda):
    """(launcher, workers): the launcher prepared, each worker built from its spec in this process."""
    launcher = Launcher(args, cuda=cuda)
    workers = []
    try:
        launcher.prepare()
        launcher.next_incarnation()
        for spec in launcher.worker_specs():
            workers.append(build_worker(spec, lambda: True, cuda=cuda))
    except BaseException:
        stop(launcher, workers)
        raise
    return launcher, workers


def stop(launcher: Launcher, workers) -> None:
    for worker in workers:
        worker.close()
    launcher.stop()


@pytest.mark.parametrize("device", DEVICES, ids=["'cuda'", "'cuda:0'", "torch.device(cuda,0)"])
@pytest.mark.parametrize("policy,backend", POLICIES)
def test_each_policys_workers_start_on_device_zero(policy, backend, device, tiny_config, gpu_env, smctrl):
    cuda = FakeCuda()
    launcher, workers = start_workers_as_the_launcher_does(server_args(device, policy, backend, tiny_config), cuda)
    try:
        instance = launcher.instance_id
        assert launcher.device == GPU and launcher.device.index == 0
        assert launcher.total_units == cuda.sms  # the SMs of device 0, asked of CUDA
        assert ("sm_count", GPU) in cuda.calls and ("make_current", GPU) in cuda.calls
        roles = [w.spec.role for w in workers]
        assert roles == ([Role.UNIFIED] if policy.startswith(("chunked", "sglang")) else [Role.PREFILL, Role.DECODE])
        for worker in workers:
            shared = worker.spec.model
            assert isinstance(shared.device, torch.device) and shared.device == GPU
            assert worker.partition.name == RESOLVED.get(backend, backend)
            assert worker.partition.total_units == cuda.sms
            stream = worker.driver.core.env.executor.stream
            assert stream is not None and stream.on_gpu  # every step launches on the worker's own stream
            assert worker.driver.core.env.executor.runner.device == torch.device("cpu")  # the fake's host tensors
        assert cuda.devices_asked() == {GPU}, cuda.calls  # no consumer was handed anything else
        if backend == "green-ctx":
            assert cuda.driver.devices and set(cuda.driver.devices) == {0}
        if backend == "libsmctrl":
            assert smctrl.last_device() == 0
        # decode-only steps (the decode worker's, the unified worker's) get graphs as the backend allows,
        # captured at start-up through the fake's graph API; the replay record is keyed by device 0's name
        graphed = next(w for w in workers if w.spec.role is not Role.PREFILL)
        mode = DECODE_GRAPHS[RESOLVED.get(backend, backend)]
        assert graphed.decode is not None and graphed.decode.decision.mode == mode
        assert sum(len(api.bodies) for api in cuda.graph_apis) > 0 or mode == EAGER
        if RESOLVED.get(backend, backend) != "none":
            assert ("device_name", GPU) in cuda.calls
    finally:
        stop(launcher, workers)
    assert not bullet_segments(instance)


def _build_in_spawned_worker(spec, cuda, out) -> None:
    """A spawned process's view, as a worker process gets its spec (pickled by spawn)."""
    import bullet.partition.cuda_driver as driver

    driver.cuda_driver_version = lambda: None
    worker = build_worker(spec, lambda: True, cuda=cuda)
    try:
        out.put((type(spec.model.device).__name__, str(spec.model.device), worker.partition.name,
                 sorted({str(d) for _, d in cuda.calls}), list(cuda.driver.devices)))
    finally:
        worker.close()


def test_the_device_crosses_the_spawn_boundary_as_a_torch_device(tiny_config, gpu_env):
    """The spec travels to a spawned process as the launcher sends it: the device arrives a
    torch.device with index 0 and the worker builds its green-context partition on device 0."""
    cuda = FakeCuda()
    args = server_args("cuda", "static", "green-ctx", tiny_config)
    launcher, workers = start_workers_as_the_launcher_does(args, cuda)
    try:
        spec = next(w.spec for w in workers if w.spec.role is Role.DECODE)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_build_in_spawned_worker, args=(spec, FakeCuda(), out))
        proc.start()
        result = out.get(timeout=120)
        proc.join(30)
    finally:
        stop(launcher, workers)
    assert proc.exitcode == 0
    assert result == ("device", "cuda:0", "green-ctx", ["cuda:0"], [0, 0])


def test_a_device_name_never_reaches_a_consumer(tiny_config):
    """What would have caught the first GPU run's crash at once: a string is refused by name."""
    from bullet.partition.launch_stream import open_worker_partition

    with pytest.raises(TypeError, match="expected a torch.device"):
        open_worker_partition("none", "decode", "cuda", {"total_units": 132}, FakeCuda())
    with pytest.raises(TypeError, match="has no index"):
        open_worker_partition("green-ctx", "decode", torch.device("cuda"), {}, FakeCuda())


def test_tensor_parallel_ranks_on_a_gpu_are_refused_before_anything_loads(tmp_path):
    """`--tp-size 2 --device cuda:0`: NCCL ranks are not built, so the launcher refuses at once, naming
    the flag and the device (nothing loaded, no segment created)."""
    args = ServerArgs(device="cuda:0", tp_size=2, load_format="dummy", max_total_tokens=256)
    with pytest.raises(ValueError, match=r"--tp-size 2 on cuda:0: .*CPUs only"):
        Launcher(args, cuda=FakeCuda())


def test_a_bullet_server_on_a_gpu_measures_its_profile_once_and_says_so(tiny_config, gpu_env, monkeypatch, caplog):
    """`--policy bullet` on a GPU without `--estimator-profile`: the launcher's own path measures the GPU
    profile (under the backend it serves with, decode as graph replays where that backend replays them)
    and says "measuring" before it does; the next server finds it cached and names it instead. The
    measurement itself is faked (it needs a GPU); everything around it is the launcher's."""
    import logging

    from estimator.profiler import cuda_measure

    measured = []

    def measure(model_path, load_format, dtype, factory, backend, quick, path, **options):
        measured.append((backend, quick, options))
        path.write_text(SHIPPED_PROFILE.read_text())

    monkeypatch.setattr(cuda_measure, "gpu_identity", lambda device=0: "Fake GPU (132 SMs)")
    monkeypatch.setattr(cuda_measure, "measure_cuda_profile", measure)
    # the shipped profile was measured on an H200: here any profile at the path fits
    monkeypatch.setattr(cuda_measure, "cuda_reusable", lambda path, *rest: path.exists())
    args = server_args("cuda", "bullet", "green-ctx", tiny_config).model_copy(update={"estimator_profile": None})
    paths = []
    for _ in range(2):
        caplog.clear()
        launcher = Launcher(args, cuda=FakeCuda())
        with caplog.at_level(logging.INFO, logger="bullet.launcher"):
            try:
                launcher.prepare()
                paths.append(launcher.estimator_profile)
            finally:
                launcher.stop()
        said = [r.getMessage() for r in caplog.records if "profile" in r.getMessage()]
        if len(paths) == 1:
            assert any("measuring" in m and "under green-ctx" in m for m in said), said
        else:
            assert said == [f"estimator profile: {paths[0]} (measured earlier on this machine)"], said
    assert DECODE_GRAPHS["green-ctx"] == PER_SHARE  # green contexts replay decode graphs, one set per share
    assert measured == [("green-ctx", True, {"decode_graphs": True})]
    assert paths[0] == paths[1]
