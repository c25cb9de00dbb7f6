"""The link between the GPUs of one server, as tensor parallelism's collectives see it: the bus
bandwidth a ring all-reduce reaches, a fixed latency per collective, and how many compute units
the collective's kernel needs to drive the link at that rate (Bullet §3.2.2's network inflection N_w).

    link = Interconnect.builtin("nvlink3")
    link.all_reduce_time(8 * 8192 * 2, ranks=8, units=108)   # 8 tokens x hidden 8192 in bf16

A ring all-reduce of `b` bytes over `n` ranks moves 2(n-1)/n x b bytes through each rank's link
(reduce-scatter, then all-gather); an all-gather of `b` bytes in all (each rank contributing b/n)
moves (n-1)/n x b. "Bus bandwidth" is NCCL-tests' busbw: the per-rank rate of exactly that traffic,
so time = traffic / busbw + latency, and one number describes a link for every rank count.

The built-in links start from spec sheets (per-direction link rates); what an all-reduce reaches
of them, the per-collective latency and N_w are assumptions until someone measures them
(`nccl-tests`' all_reduce_perf on the machine gives busbw and small-message latency directly), and
every one says so in `assumptions`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

GB = 1e9
# assumption: a large all-reduce on NCCL reaches ~80 % of the per-direction link rate as busbw (the
# share nccl-tests' all_reduce_perf commonly reports on NVSwitch and PCIe servers); not measured here
BUSBW_EFFICIENCY = 0.8


class Interconnect(BaseModel):
    """One server's GPU-to-GPU link, for collectives among its ranks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    bus_bandwidth: float = Field(gt=0, description="bytes/s: NCCL-tests busbw of a large all-reduce")
    latency_s: float = Field(ge=0, description="seconds every collective costs beyond its bytes")
    bandwidth_inflection: float = Field(gt=0, description="N_w: units the collective needs to reach busbw")
    source: str = ""
    assumptions: tuple[str, ...] = ()

    def with_rates(self, bus_bandwidth: float | None = None, latency_s: float | None = None) -> "Interconnect":
        """This link with its busbw and/or latency set by hand (a measured or hypothetical one)."""
        if bus_bandwidth is None and latency_s is None:
            return self
        update, said = {}, []
        if bus_bandwidth is not None:
            update["bus_bandwidth"] = bus_bandwidth
            said.append(f"busbw set to {bus_bandwidth / GB:g} GB/s")
        if latency_s is not None:
            update["latency_s"] = latency_s
            said.append(f"latency set to {latency_s * 1e6:g} us")
        kept = tuple(a for a in self.assumptions if not (bus_bandwidth is not None and a.startswith("busbw")
                                                         or latency_s is not None and " per collective" in a))
        return self.model_copy(update={**update, "name": f"{self.name}, {', '.join(said)}",
                                       "assumptions": kept + (f"{' and '.join(said)} by the run",)})

    def rate(self, units: float) -> float:
        """busbw with `units` units running the collective: W_p = W_peak * min(1, N_p / N_w)."""
        return self.bus_bandwidth * min(1.0, units / self.bandwidth_inflection)

    def all_reduce_time(self, nbytes: float, ranks: int, units: float) -> float:
        """Seconds of a ring all-reduce of `nbytes` (each rank's full tensor) over `ranks` ranks."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.latency_s + 2.0 * (ranks - 1) / ranks * nbytes / self.rate(units)

    def all_gather_time(self, nbytes: float, ranks: int, units: float) -> float:
        """Seconds of a ring all-gather whose result is `nbytes` (each rank contributes 1/ranks of it)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.latency_s + (ranks - 1) / ranks * nbytes / self.rate(units)

    @classmethod
    def builtin(cls, name: str) -> "Interconnect":
        key = name.lower()
        if key not in LINKS:
            raise ValueError(f"unknown link {name!r}; known: {', '.join(sorted(LINKS))}")
        return LINKS[key]


def _link(name: str, per_direction_gb_s: float, latency_us: float, n_w: float, source: str,
          assumptions: tuple[str, ...], efficiency: float = BUSBW_EFFICIENCY) -> Interconnect:
    return Interconnect(
        name=name, bus_bandwidth=per_direction_gb_s * efficiency * GB, latency_s=latency_us / 1e6,
        bandwidth_inflection=n_w, source=source,
        assumptions=(f"busbw = {efficiency:.0%} of the spec's {per_direction_gb_s:g} GB/s per direction "
                     "(an NCCL-tests-style expectation, not measured)",
                     f"{latency_us:g} us per collective (small-message all-reduce on 8 GPUs; not measured)",
                     f"N_w = {n_w:g} SMs drive the link (NCCL's channels are one thread block each; not measured)")
        + assumptions)


_NVLINK_SPEC = "NVIDIA spec sheets: NVLink per-GPU bandwidth (bidirectional), halved for one direction"
LINKS: dict[str, Interconnect] = {
    # A100 SXM4: 12 third-generation NVLinks x 50 GB/s = 600 GB/s both ways, all GPUs through NVSwitch (HGX)
    "nvlink3": _link("NVLink3 (A100 SXM4, NVSwitch)", 300, 20, 16, _NVLINK_SPEC, ()),
    # H100/H200 SXM5, H20: 18 fourth-generation NVLinks x 50 GB/s = 900 GB/s both ways
    "nvlink4": _link("NVLink4 (H100/H200 SXM5, NVSwitch)", 450, 20, 16, _NVLINK_SPEC,
                     ("NVLink SHARP (in-switch reduction) not modelled: a ring all-reduce",)),
    # a PCIe 4.0 x16 slot per GPU, GPUs talking through PCIe switches / the host
    "pcie4": _link("PCIe 4.0 x16", 32, 30, 4, "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes ~ 32 GB/s per direction", ()),
    # Bullet's own 8xA100-80GB server (Bullet Table 3, "Intra-node Bandwidth 20 GB/s"): taken as the
    # all-reduce's busbw, latency as PCIe's
    "bullet-a100": Interconnect(
        name="Bullet Table 3's 8xA100-80GB (20 GB/s intra-node)", bus_bandwidth=20 * GB, latency_s=30e-6,
        bandwidth_inflection=4, source="Bullet §4.1 Table 3: intra-node bandwidth of its 8xA100-80GB server",
        assumptions=("the table's 20 GB/s taken as NCCL-tests busbw (the paper does not say how it was measured)",
                     "30 us per collective, as PCIe's (not measured)",
                     "N_w = 4 SMs drive the link (not measured)")),
}
