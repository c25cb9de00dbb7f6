"""What the launcher hands a worker process when it starts it (pickled by multiprocessing's spawn,
between our own processes: the shared tensors travel by handle)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.config import ServerArgs
from bullet.shared.endpoints import Endpoints
from bullet.shared.model import SharedModel
from bullet.types.roles import Role


@dataclass
class WorkerSpec:
    role: Role
    instance_id: str
    incarnation: int
    args: ServerArgs
    model: SharedModel
    endpoints: Endpoints
    runtime_dir: str  # the instance's private socket directory (removed by the last one out)
    cores: list[int]
    launcher_pid: int
    initial_units: int = 1
    estimator_profile: str | None = None  # the bullet policy's profile
    # the device's units as the launcher counted them (its SMs on a GPU): a worker capped by MPS
    # (`mps-percentage`) sees only its cap through torch, and would apply the cap to it a second time
    total_units: int | None = None
    tp_rank: int = 0  # under --tp-size: which rank of the worker this process is (0 schedules, the rest follow)

    @property
    def title(self) -> str:
        """The process title `ps` shows, as SGLang names its processes."""
        rank = f" tp_rank={self.tp_rank}" if self.args.tp_size > 1 else ""
        return f"bullet::{self.role.value}{rank} port={self.args.port} instance={self.instance_id}"
