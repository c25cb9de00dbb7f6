"""The GPU profiler without a GPU: share selection, the kernel sweep's steps against the real layer,
the plan run with a fake share control, a fake co-runner and a fake timer that reports a synthetic
"true" GPU — whose times the calibration (the CPU profile's Eq. 2 code) must then reproduce on states
it never measured — and the probe's hardware description. CUDA event timing runs only on a GPU."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engines.model_config import ModelConfig
from engines.weights.dummy import dummy_weights
from estimator.estimator import Estimator
from estimator.hardware import BUILTIN
from estimator.profiler.cuda_ops import PER_STEP, ClassRun, check_steps_compose_layer, class_runs, op_times
from estimator.profiler.cuda_probe import builtin_for, gpu_hardware, interpolate, probe_rates
from estimator.profiler.cuda_sweep import run_cuda_plan
from estimator.profiler.fit import build_estimator
from estimator.profiler.kernel_timing import kernel_times
from estimator.profiler.plan import gpu_plan
from estimator.profiler.prediction_errors import predict
from estimator.profiler.session import op_samples, phase_sample
from estimator.profiler.shares import corun_splits, profiled_shares, round_up
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase, kv_tokens_needed, uniform_decode
from tests.partition.tiny_model import CONFIG

H100_GREEN = list(range(8, 129, 8)) + [132]
H100_TPC = list(range(2, 133, 2))


# ---- which shares -----------------------------------------------------------------------------------

def test_profiled_shares_are_the_granted_shares_nearest_each_fraction():
    # an eighth, a quarter, a half of 132 SMs: the shares a server's green-context pool holds (16, 32,
    # 64), not rounded up past them (24, 40, 72: the served 16 SMs were then an extrapolation)
    assert profiled_shares(H100_GREEN, quick=True) == [16, 32, 64, 132]
    assert profiled_shares(H100_TPC) == [16, 34, 50, 66, 100, 132]
    assert profiled_shares([1, 2], quick=True) == [1, 2]  # a CPU's cores: as before
    assert profiled_shares(list(range(1, 9))) == [1, 2, 3, 4, 6, 8]
    assert profiled_shares([132]) == [132]  # the none backend: only the whole device
    assert round_up(H100_GREEN, 129) == 132 and round_up(H100_GREEN, 500) == 132


def test_corun_splits_are_disjoint_and_fill_the_device():
    splits = corun_splits(H100_GREEN, H100_GREEN)
    assert splits == [(96, 32), (64, 64)]  # decode on the share nearest its fraction, prefill on what is left
    for prefill, decode in splits:
        assert prefill + decode <= 132
    assert corun_splits(H100_TPC, H100_TPC) == [(98, 34), (66, 66)]
    assert corun_splits([132], [132]) == []  # nothing to split without a partition


# ---- the kernel sweep's steps ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench():
    """The tiny model, with a context long enough for the GPU plan's states."""
    config = CONFIG.model_copy(update={"max_position_embeddings": 8192})
    plan = gpu_plan(quick=True)
    return ModelBench(config, dummy_weights(config, torch.float32), kv_tokens_needed(plan.all_cases()), torch.float32)


@pytest.mark.parametrize("case", [PrefillCase((37, 5)), PrefillCase((12,)), uniform_decode(3, 40)])
def test_the_sweep_steps_compose_the_real_layer_bit_for_bit(bench, case):
    check_steps_compose_layer(bench, case)


def test_the_composition_check_catches_a_layer_the_sweep_does_not_follow(bench, monkeypatch):
    import estimator.profiler.cuda_ops as ops

    original = ops.layer_steps

    def drifted(*args):
        steps = original(*args)
        name, act = steps[8]
        assert name == "act"
        steps[8] = (name, lambda layer, s: {**act(layer, s), "a": act(layer, s)["a"] * 1.0001})
        return steps

    monkeypatch.setattr(ops, "layer_steps", drifted)
    with pytest.raises(AssertionError, match="no longer follows"):
        check_steps_compose_layer(bench, PrefillCase((8,)))


def test_op_times_cover_the_cpu_sweeps_classes_per_launch(bench):
    case = uniform_decode(2, 30)
    launches = []

    def fake_time(run: ClassRun) -> float:
        launches.append(run.kernel_class)
        run()  # the run really launches its class once per layer, on the bench's model
        return 1e-3

    times = op_times(bench, case, fake_time)
    cpu_times, _ = kernel_times(bench, case)
    assert set(times) == set(cpu_times)
    layers = bench.model.num_layers
    for name, seconds in times.items():
        assert seconds == pytest.approx(1e-3 if name in PER_STEP else 1e-3 / layers)
    assert launches.count("residual_add") == 2  # both residual adds of the layer are timed


# ---- the plan against a synthetic GPU ------------------------------------------------------------------

LLAMA_8B = ModelConfig.builtin("llama-3.1-8b")
SPEC = BUILTIN["h100"]
# The "real" H100 the fake timer reports: slower than its spec sheet, as real kernels are
TRUE_GPU = SPEC.model_copy(update={"peak_flops": {k: v * 0.62 for k, v in SPEC.peak_flops.items()},
                                   "peak_bandwidth": SPEC.peak_bandwidth * 0.8, "bandwidth_inflection": 40.0})
STEP_OVERHEAD_S = 1.5e-3  # Python and launches per step, which the kernel sweeps do not see
DECODE_BESIDE_PREFILL, PREFILL_BESIDE_DECODE = 1.30, 1.08
# both on every SM (the block scheduler dividing them under MPS, or contexts time-sliced without it)
DECODE_ON_SHARED, PREFILL_ON_SHARED = 1.9, 1.4


class FakeShares:
    name = "fake"
    total_units = 132

    def __init__(self, feasible):
        self._feasible, self.current, self.entered = feasible, None, []

    def feasible(self, role):
        return self._feasible

    @contextmanager
    def use(self, role, units):
        assert units in self._feasible
        self.current = (role, units)
        self.entered.append((role, units))
        yield
        self.current = None

    def close(self):
        pass


class FakeOther:
    def __init__(self):
        self.active, self.seen = None, []

    @contextmanager
    def looping(self, role, units, case):
        self.active = (role, units, case)
        self.seen.append(self.active)
        yield
        self.active = None


class TrueGpuTimer:
    """Times from the synthetic GPU for the share the fake control says is in force."""

    def __init__(self, shares: FakeShares, other: FakeOther):
        self.shares, self.other = shares, other
        self.truth = Estimator(LLAMA_8B, TRUE_GPU)

    def kernels(self, run: ClassRun) -> float:
        _, units = self.shares.current
        sample = next(s for s in op_samples(run.case, units, {k: 1.0 for k in KERNEL_KEYS}) if s.kind == run.kernel_class)
        per_launch = self.truth.kernels.srm(self.truth.kernels.sample_op(sample), units)
        return per_launch * (1 if run.kernel_class in PER_STEP else LLAMA_8B.num_hidden_layers)

    def step(self, run) -> float:
        _, units = self.shares.current
        return true_step(self.truth, run.case, units, self.other.active, self.shares.total_units)


KERNEL_KEYS = ("input_norm", "qkv_proj", "rope", "o_proj", "post_attn_norm", "gate_up_proj", "act", "down_proj",
               "residual_add", "embedding", "final_norm", "lm_head", "attn_decode", "attn_prefill")


def true_step(truth: Estimator, case, units, other, total: int = 132) -> float:
    seconds = predict(truth, phase_sample(case, units, 1.0)) + STEP_OVERHEAD_S
    if other is not None and units + other[1] > total:
        seconds *= DECODE_ON_SHARED if isinstance(case, DecodeCase) else PREFILL_ON_SHARED
    elif other is not None:
        seconds *= DECODE_BESIDE_PREFILL if isinstance(case, DecodeCase) else PREFILL_BESIDE_DECODE
    return seconds


def tagged_steps(case):
    return SimpleNamespace(case=case)


def test_plan_calibrates_to_a_synthetic_gpu_on_states_it_never_measured(bench):
    shares, other = FakeShares(H100_GREEN), FakeOther()
    timer = TrueGpuTimer(shares, other)
    plan = gpu_plan(quick=True)
    samples, notes, padded = run_cuda_plan(bench, shares, timer, plan, step_for=tagged_steps, other=other)
    assert padded is False  # the synthetic GPU's decode reads each request's own context
    assert len(notes) == 1 and "each request reads its own context" in notes[0], notes
    units = profiled_shares(H100_GREEN, quick=True)
    assert {u for _, u in shares.entered} >= set(units)
    assert {s.units for s in samples if s.kind == "attn_decode"} == set(units)
    # hybrid steps (the chunked baselines') only on the largest share, the one those baselines run on
    assert {s.units for s in samples if s.kind == "hybrid"} == {max(profiled_shares(shares.feasible("prefill"), True))}
    corun = [s for s in samples if s.co_running]
    # complementary splits, then each phase on all 132 SMs beside the other on all of them
    assert {(s.kind, s.units) for s in corun} == {("decode", 32), ("decode", 64), ("prefill", 96), ("prefill", 64),
                                                  ("decode", 132), ("prefill", 132)}
    assert {(role, u) for role, u, _ in other.seen} == {("prefill", 96), ("prefill", 64), ("decode", 32), ("decode", 64),
                                                        ("prefill", 132), ("decode", 132)}
    assert {(s.kind, s.co_units) for s in corun if s.units == 132} == {("decode", 132), ("prefill", 132)}

    fitted = build_estimator(LLAMA_8B, SPEC, "bf16", samples)
    spec_only = Estimator(LLAMA_8B, SPEC)
    truth = timer.truth
    held_out = [(PrefillCase((1024,)), 48), (PrefillCase((700, 300)), 96), (uniform_decode(64, 768), 40),
                (uniform_decode(16, 3000), 56), (PrefillCase((4096,), 8), 104)]
    fitted_err, spec_err = [], []
    for case, u in held_out:
        want = true_step(truth, case, u, None)
        fitted_err.append(abs(predict(fitted, phase_sample(case, u, 1.0)) / want - 1))
        spec_err.append(abs(predict(spec_only, phase_sample(case, u, 1.0)) / want - 1))
    # between profiled shares (40 SMs lies between 32 and 64) the calibration interpolates: ~10 %
    assert max(fitted_err) < 0.15 and sum(fitted_err) / len(fitted_err) < 0.05, fitted_err
    assert sum(spec_err) / len(spec_err) > 0.25, spec_err  # what calibration had to fix
    # contention: decode beside a prefill is predicted slower than alone, as measured
    case, u = uniform_decode(32, 1024), 32
    alone = predict(fitted, phase_sample(case, u, 1.0))
    beside = predict(fitted, phase_sample(case, u, 1.0, co_running=2048))
    assert beside / alone == pytest.approx(DECODE_BESIDE_PREFILL, rel=0.1)
    # the shared-SM steps give their own factors, and leave the co-run tables to the disjoint splits
    shared = {p.kind: p.factor for p in fitted.contention.shared_units}
    assert shared == {"prefill": pytest.approx(PREFILL_ON_SHARED, rel=0.1), "decode": pytest.approx(DECODE_ON_SHARED, rel=0.1)}


def test_without_a_co_runner_contention_is_noted_as_unmeasured(bench):
    shares = FakeShares([132])
    timer = TrueGpuTimer(shares, FakeOther())
    samples, notes, _ = run_cuda_plan(bench, shares, timer, gpu_plan(quick=True), step_for=tagged_steps)
    assert not any(s.co_running for s in samples)
    assert {s.units for s in samples} == {132}
    assert "contention not measured" in notes[-1]


def test_the_plans_log_lines_are_what_from_log_reads_back(bench):
    """`from_log` rebuilds a profile from these printed lines when the profile file is lost: every
    step and kernel sweep the plan measures must come back from its line, beside what it ran."""
    from estimator.profiler.from_log import parse_log

    shares, other = FakeShares(H100_GREEN), FakeOther()
    decode = uniform_decode(8, 256)
    plan = replace(gpu_plan(quick=True), sweeps=(PrefillCase((512,)), decode),
                   steps=(PrefillCase((512,)), PrefillCase((512, 64), 4), decode), corun_prefill_lengths=(512,),
                   corun_decode_cases=(decode,), corun_decode_batches=(8,), corun_prefill_cases=(PrefillCase((512,)),))
    lines = ["24 SMs: 166 TFLOP/s, 1771 GB/s;"]  # the probe's line, printed by cuda_measure before the plan
    samples, _, _ = run_cuda_plan(bench, shares, TrueGpuTimer(shares, other), plan, step_for=tagged_steps, other=other,
                               log=lines.append)
    _, _, sweeps, phases = parse_log(lines)
    measured = [s for s in samples if s.kind in ("prefill", "decode")]
    assert any(s.co_running for s in measured)
    assert any(s.co_units == 132 for s in measured)  # the shared-SM steps say the other held every SM
    assert [(p.kind, p.units, p.co_running, p.co_units, p.prefill_lens, p.num_layers, p.decode_batch, p.decode_context)
            for p in phases] == [(s.kind, s.units, s.co_running, s.co_units, s.prefill_lens, s.num_layers, s.decode_batch,
                                  s.decode_context) for s in measured]
    assert all(p.seconds == pytest.approx(s.seconds, abs=1e-5) for p, s in zip(phases, measured))  # ms, 2 decimals
    assert len(sweeps) == len(plan.sweeps) * len(profiled_shares(H100_GREEN, quick=True))


# ---- the probe ------------------------------------------------------------------------------------

def test_interpolation_is_linear_between_measured_shares_and_zero_based_below():
    table = interpolate({16: 160.0, 32: 240.0, 132: 300.0}, 132)
    assert len(table) == 132
    assert table[15] == 160.0 and table[7] == pytest.approx(80.0) and table[23] == pytest.approx(200.0)
    assert table[131] == 300.0 and table[81] == pytest.approx(270.0)


def test_probe_and_hardware_description():
    def fake_time(run):
        return run()  # the fake kernels return their duration

    current = {}

    @contextmanager
    def use(units):
        current["units"] = units
        yield

    gemm_flops, copy_bytes = 2.0 * 8192**3, 2.0 * (1 << 30)
    flops_at = lambda u: 600e12 * u / 132  # compute scales with SMs
    bw_at = lambda u: 2.8e12 * min(1.0, u / 40)  # bandwidth saturates at 40
    flops, bandwidth = probe_rates([16, 40, 72, 132], use, fake_time,
                                   lambda: gemm_flops / flops_at(current["units"]), gemm_flops,
                                   lambda: copy_bytes / bw_at(current["units"]), copy_bytes)
    assert flops[132] == pytest.approx(600e12) and bandwidth[16] == pytest.approx(2.8e12 * 16 / 40)
    hw = gpu_hardware("NVIDIA H100 80GB HBM3", 132, "bf16", flops, bandwidth, 8, 8, "green-ctx")
    assert hw.units == 132 and hw.partition_step == 8 and hw.min_partition == 8
    assert hw.bandwidth_inflection == 40.0 and hw.memory_bytes == SPEC.memory_bytes
    assert hw.compute_rate(66, "bf16") == pytest.approx(300e12)
    assert hw.bandwidth(100) == pytest.approx(2.8e12)
    # the paged Triton decode kernel cuts each row's own context; the profile's padding probe decides
    assert not hw.decode_attention_padded and hw.prefill_attention_per_sequence
    assert math.isclose(hw.flops("bf16"), 600e12)


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA H200", "h200"), ("NVIDIA H20", "h20"), ("NVIDIA L4", None)])
def test_spec_sheets_are_found_by_cuda_device_name(name, key):
    found = builtin_for(name)
    assert (found is None) if key is None else (found is BUILTIN[key])


# ---- on a GPU only --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA timing needs a GPU")


@pytest.mark.gpu
@gpu
def test_cuda_event_timer_and_the_none_share_control_on_a_gpu():
    from bullet.partition.share_control import PartitionShares
    from estimator.profiler.cuda_timing import CudaEventTimer

    shares = PartitionShares("none")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    with shares.use("prefill", shares.total_units):
        kernels = CudaEventTimer().kernels(lambda: a @ a)
        graphed = CudaEventTimer(graphs=True).kernels(lambda: a @ a)
    assert 0 < kernels < 0.1 and 0 < graphed < 0.1
    shares.close()


def test_class_runs_are_named_for_the_timer(bench):
    runs = class_runs(bench, uniform_decode(2, 20))
    assert all(r.kernel_class == name for name, rs in runs.items() for r in rs)


def test_bullet_profile_on_cuda_says_when_there_is_no_gpu(capsys):
    from bullet.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command would profile it")
    assert main(["profile", "--device", "cuda", "--quick"]) == 2
    assert capsys.readouterr().err.startswith("bullet profile: --device cuda: no CUDA device is visible")


def test_the_share_factory_for_the_co_runner_pickles():
    import pickle

    from bullet.commands.profile import share_factory
    from bullet.partition.share_control import PartitionShares

    factory = pickle.loads(pickle.dumps(share_factory("libsmctrl", "/opt/libsmctrl.so", True)))
    assert factory.func is PartitionShares and factory.args == ("libsmctrl",)
    assert factory.keywords == {"library": "/opt/libsmctrl.so", "allow_untested_driver": True}
    assert share_factory("green-ctx").keywords == {}
