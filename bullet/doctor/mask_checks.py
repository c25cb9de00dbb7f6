"""Do SM partitions really confine kernels? Launch the %smid probe on partitioned streams — directly
and as a CUDA graph replay — and compare the SMs it ran on with the SMs the backend granted.

Graph replays matter because decode runs as CUDA graphs: MuxWise's authors report that libsmctrl
masks did not change the SMs of graph replays, Bullet's repository has a test claiming they do. So
this is measured, never assumed: a graph is captured under one mask, replayed under it, then the
mask is narrowed and the graph replayed again; every replay must stay inside the mask in force.
Green contexts are checked per pool stream, and the prefill and decode pools (each from its own
split, as in two processes) must not share SMs when their counts fit the device."""

from __future__ import annotations

import os

from bullet.doctor.gpu_checks import skip_gpu
from bullet.doctor.results import CheckResult, failed, passed, skipped
from bullet.doctor.smid_probe import ProbeUnavailable, load_probe_for_current_device
from bullet.partition import PartitionUnavailable, format_id_list
from bullet.partition.graph_policy import ReplayVerdict, current_device_identity, record_replay_verdict
from bullet.partition.green_ctx import GreenContextBackend
from bullet.partition.libsmctrl import LIBRARY_ENV, LibSmCtrlBackend
from bullet.partition.mps import detect_mps


def _probe():
    try:
        return load_probe_for_current_device(), None
    except (ProbeUnavailable, OSError) as e:
        return None, f"cannot build the %smid probe: {e}"


def _replay(graph, stream, buffer, probe) -> set[int]:
    import torch

    with torch.cuda.stream(stream):  # CUDAGraph.replay launches on the current stream
        buffer.fill_(-1)
        graph.replay()
    return probe.observed(buffer)


def check_libsmctrl_masks(no_gpu: str | None, library: str | None, allow_untested: bool) -> CheckResult:
    name = "libsmctrl masks confine kernels (incl. graph replay)"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch

    if not (library or os.environ.get(LIBRARY_ENV)):
        return skipped(name, f"no libsmctrl given (--libsmctrl PATH or {LIBRARY_ENV})")
    probe, why = _probe()
    if probe is None:
        return skipped(name, why)
    streams = {role: torch.cuda.Stream() for role in ("prefill", "decode")}
    try:
        backends = {role: LibSmCtrlBackend(role, stream=s.cuda_stream, library=library,
                                           allow_untested_driver=allow_untested)
                    for role, s in streams.items()}
    except PartitionUnavailable as e:
        return failed(name, str(e))
    total = backends["prefill"].total_units
    quarter, half = (backends["prefill"].round_units(max(1, total * f // 4)) for f in (1, 2))
    findings, problems = [], []

    def verify(label, backend, seen) -> bool:
        outside = seen - backend.unit_set()
        findings.append({"case": label, "granted": format_id_list(backend.unit_set()),
                         "seen": format_id_list(seen), "outside": format_id_list(outside)})
        if not seen:
            problems.append(f"{label}: probe saw no SM")
        elif outside:
            problems.append(f"{label}: ran on SMs {format_id_list(outside)} outside the mask")
        return bool(seen) and not outside

    direct = True
    for role, units in (("prefill", quarter), ("decode", half), ("prefill", total)):
        b = backends[role]
        b.apply(units)
        direct &= verify(f"{role} {units} SMs, direct launch", b, probe.run(streams[role].cuda_stream, total))

    prefill, stream = backends["prefill"], streams["prefill"]
    prefill.apply(half)
    buffer = probe.buffer(total)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        probe.launch(stream.cuda_stream, buffer)
    same = verify(f"graph captured and replayed under {half} SMs", prefill, _replay(graph, stream, buffer, probe))
    prefill.apply(quarter)
    after = verify(f"same graph replayed after narrowing to {quarter} SMs", prefill,
                   _replay(graph, stream, buffer, probe))
    # what decode's CUDA graphs may do under libsmctrl on this GPU and driver (graph_policy)
    verdict = ReplayVerdict(direct, same, after, "; ".join(problems))
    record = record_replay_verdict("libsmctrl", *current_device_identity(), verdict)
    details = {"findings": findings, "apply_cost": prefill.apply_costs().as_dict(), "verdict_record": str(record)}
    if problems:
        return failed(name, "; ".join(problems), **details)
    return passed(name, f"{len(findings)} cases on {total} SMs stayed inside their masks, graph replays "
                        "follow the mask in force", **details)


def ids_look_virtualised(seen: dict[tuple[str, int], set[int]]) -> bool:
    """Whether every pool stream of N SMs, of both roles, reported exactly the ids 0..N-1: what MPS
    showed on an H200 (driver 13.0), where %smid then says nothing about which physical SMs two
    pools hold — disjointness is for the cross-process timing check to judge."""
    partial = [ids for (_, sms), ids in seen.items() if ids and len(ids) < max(s for _, s in seen)]
    return bool(partial) and all(ids == set(range(len(ids))) for ids in seen.values() if ids)


def check_green_ctx_pools(no_gpu: str | None) -> CheckResult:
    name = "green-context pools confine kernels (incl. graph replay)"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch

    probe, why = _probe()
    if probe is None:
        return skipped(name, why)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    counts = [total // 4, total // 2, 3 * total // 4]  # a few shares: each green context costs memory
    try:
        pools = {role: GreenContextBackend(role, counts=counts) for role in ("prefill", "decode")}
    except PartitionUnavailable as e:
        return skipped(name, str(e))
    seen, problems, overlaps, replayed = {}, [], [], set()
    virtualised = False
    direct = replay_ok = False
    try:
        for role, backend in pools.items():
            for sms, handle in backend.pool_streams().items():
                ids = probe.run(handle, total)
                seen[(role, sms)] = ids
                if not ids or len(ids) > sms:
                    problems.append(f"{role} pool stream of {sms} SMs ran on {len(ids)} SMs")
        direct = not problems
        virtualised = ids_look_virtualised(seen) and detect_mps().running
        for (role_a, a), ids_a in seen.items():
            for (role_b, b), ids_b in seen.items():
                if role_a == "prefill" and role_b == "decode" and a + b <= total and ids_a & ids_b:
                    overlaps.append(f"prefill {a} and decode {b} share SMs {format_id_list(ids_a & ids_b)}")
        if not virtualised:
            problems += overlaps
        sms, handle = sorted(pools["decode"].pool_streams().items())[0]
        stream = torch.cuda.ExternalStream(handle)
        buffer = probe.buffer(total)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            probe.launch(handle, buffer)
        replayed = _replay(graph, stream, buffer, probe)
        replay_ok = 0 < len(replayed) <= sms  # the probe sees SM ids, not which green context owns them
        if len(replayed) > sms:
            problems.append(f"graph captured on the {sms}-SM stream replayed on {len(replayed)} SMs")
    finally:
        for backend in pools.values():
            backend.close()
    # a green context's stream never changes share: replays are checked on their capture stream
    record = record_replay_verdict("green-ctx", *current_device_identity(),
                                   ReplayVerdict(direct, replay_ok, None, "; ".join(problems)))
    details = {"observed": {f"{r} {s}": format_id_list(ids) for (r, s), ids in sorted(seen.items())},
               "graph_replay": format_id_list(replayed), "verdict_record": str(record)}
    if problems:
        return failed(name, "; ".join(problems), **details)
    if virtualised:
        return skipped(name, f"{len(seen)} pool streams stayed within their SM counts, but under MPS every pool of "
                             "N SMs reports SM ids 0..N-1: %smid cannot tell whether the prefill and decode pools "
                             "are disjoint here (the cross-process isolation check times it)",
                       unjudged_overlaps=overlaps, **details)
    return passed(name, f"{len(seen)} pool streams stayed within their SM counts, prefill/decode pools "
                        "disjoint, graph replay confined", **details)
