"""A worker split over tensor-parallel ranks (`--tp-size N`): N processes, rank i holding the i-th
shard of the weights and of the KV pool (`bullet.shared.model.shard_shared_model`), joined in one
gloo group per worker. Rank 0 is the worker as it is without ranks — sockets, scheduler, sampling —
whose runner sends every call to the other ranks first (`engines.tensor_parallel.LeadingRunner`);
ranks 1.. run `follow_main`: they make the same calls on their shard and meet rank 0 in each layer's
all-reduces, on their part of the worker's current share of cores.

The group meets through a file store in the instance's private socket directory, and gloo's
connections are bound to the loopback interface. A follower keeps no state worth saving: SIGTERM
ends it at once (it may be blocked inside a collective, where no Python handler would run), and a
rank whose peer died raises out of its collective and exits — the launcher then restarts the whole
worker, every rank of it."""

from __future__ import annotations

import datetime
import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from bullet.partition.launch_stream import open_worker_partition
from bullet.workers.spec import WorkerSpec
from engines.tensor_parallel import follow, parallelize

log = logging.getLogger("bullet.worker")
# a follower waits in a collective for rank 0's next call for as long as the server is idle: the
# group's timeout must outlast any idle period (a dead peer is noticed by its closed connection)
GROUP_TIMEOUT = datetime.timedelta(days=30)


def rendezvous_path(spec: WorkerSpec) -> Path:
    """Where the ranks of this worker's incarnation meet (a new file for each restart)."""
    return Path(spec.runtime_dir) / f"tp-{spec.role.value}-{spec.incarnation}.store"


def join_rank_group(spec: WorkerSpec, model) -> dist.ProcessGroup:
    """Join this worker's group as rank `spec.tp_rank` of `--tp-size` (blocks until every rank has),
    and make `model`'s row-parallel projections sum over it."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks' connections stay on this machine
    store = dist.FileStore(str(rendezvous_path(spec)), spec.args.tp_size)
    dist.init_process_group("gloo", store=store, rank=spec.tp_rank, world_size=spec.args.tp_size,
                            timeout=GROUP_TIMEOUT)
    parallelize(model, dist.group.WORLD)
    return dist.group.WORLD


def share_threads(spec: WorkerSpec, partition) -> None:
    """Under `--partition-backend none` nothing divides the cores: each rank takes its part of them
    (the cpu backend gives each rank its part of the worker's share itself)."""
    if spec.args.tp_size > 1 and partition.name == "none":
        torch.set_num_threads(max(1, len(spec.cores) // spec.args.tp_size))


def follow_main(spec: WorkerSpec) -> int:
    """A following rank's process: build its shard's runner, join the group, follow rank 0 until it
    says stop. Returns the exit code."""
    from bullet.workers.wiring import backend_options, model_runner  # deferred: wiring imports this module

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    shared = spec.model
    partition, _ = open_worker_partition(spec.args.partition_backend, spec.role.partition_side, shared.device,
                                         backend_options(spec))
    partition.apply(spec.initial_units)
    share_threads(spec, partition)
    torch.set_grad_enabled(False)
    model, runner = model_runner(shared, shared.device, shared.device)
    group = join_rank_group(spec, model)
    log.info("rank %d of %d: %d query / %d KV heads, MLP width %d", spec.tp_rank, spec.args.tp_size,
             shared.config.num_attention_heads, shared.config.num_key_value_heads, shared.config.intermediate_size)
    calls = follow(runner, group, apply_units=partition.apply)
    log.info("rank %d: stopped by rank 0 after %d calls", spec.tp_rank, calls)
    return 0
