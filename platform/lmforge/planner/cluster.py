"""The cluster a plan is for, read from "nodes=4,gpus_per_node=8,gpu_mem=80GB".

Beyond the three required fields, the throughput model's hardware figures can be
given too (defaults: an H100/H200 SXM node): `peak_tflops` (dense bf16 per GPU;
fp32 runs at half, TF32), `efficiency` (the share of peak the matmuls reach),
`intra_gbps` and `inter_gbps` (GB/s per GPU that a ring collective achieves inside
a node, NVLink, and between nodes, one 400 Gb/s NIC per GPU), and for CPU offload
`host_gbps` (GB/s per GPU between host and device memory, PCIe 5 x16), `cpu_gbps`
(GB/s of host memory one rank's optimizer step on the CPU streams through) and
`host_mem` (each node's host memory, a size).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.errors import UserError
from lmforge.sizes import parse_size

REQUIRED = ("nodes", "gpus_per_node", "gpu_mem")
HARDWARE = {"peak_tflops": 989.0, "efficiency": 0.5, "intra_gbps": 300.0, "inter_gbps": 40.0, "host_gbps": 50.0, "cpu_gbps": 10.0}
HOST_MEM = 2 * 10**12  # a DGX H100's
# Kept free of the estimate: CUDA context, NCCL buffers and allocator fragmentation.
RESERVED_FRACTION = 0.1
FORMAT = "expected nodes=N,gpus_per_node=G,gpu_mem=80GB"


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem: int  # bytes
    peak_tflops: float = HARDWARE["peak_tflops"]
    efficiency: float = HARDWARE["efficiency"]
    intra_gbps: float = HARDWARE["intra_gbps"]
    inter_gbps: float = HARDWARE["inter_gbps"]
    host_gbps: float = HARDWARE["host_gbps"]
    cpu_gbps: float = HARDWARE["cpu_gbps"]
    host_mem: int = HOST_MEM  # bytes per node

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable(self) -> int:
        """Device bytes a job's estimate may take."""
        return int(self.gpu_mem * (1 - RESERVED_FRACTION))

    @property
    def usable_host_per_gpu(self) -> int:
        """Host bytes one rank's offloaded states may take."""
        return int(self.host_mem * (1 - RESERVED_FRACTION) / self.gpus_per_node)

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPUs x {self.gpu_mem / 1e9:g} GB"


def parse_cluster(text: str) -> Cluster:
    """ "nodes=4,gpus_per_node=8,gpu_mem=80GB" -> Cluster; UserError naming --cluster."""
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in (*REQUIRED, *HARDWARE, "host_mem"):
            raise UserError(f"--cluster: cannot read {item!r}; {FORMAT} (optional: {', '.join(HARDWARE)}, host_mem)")
        fields[key] = value
    missing = [key for key in REQUIRED if key not in fields]
    if missing:
        raise UserError(f"--cluster: {', '.join(missing)} missing; {FORMAT}")
    counts = {}
    for key in ("nodes", "gpus_per_node"):
        if not fields[key].isdigit() or int(fields[key]) == 0:
            raise UserError(f"--cluster: {key} must be a whole number above 0, got {fields[key]!r}")
        counts[key] = int(fields[key])
    hardware = {}
    for key in HARDWARE:
        if key in fields:
            try:
                hardware[key] = float(fields[key])
            except ValueError:
                hardware[key] = 0.0
            if not hardware[key] > 0 or (key == "efficiency" and hardware[key] > 1):
                raise UserError(f"--cluster: {key} must be a number above 0{' and at most 1' if key == 'efficiency' else ''}, got {fields[key]!r}")
    sizes = {}
    for key in ("gpu_mem", "host_mem"):
        if key in fields:
            try:
                sizes[key] = parse_size(fields[key])
            except ValueError as err:
                raise UserError(f"--cluster: {key} {err}") from None
    return Cluster(counts["nodes"], counts["gpus_per_node"], **sizes, **hardware)


def assumed_cluster(world_size: int, gpus_per_node: int = 8, gpu_mem: int = 80 * 10**9) -> Cluster:
    """The cluster a job's own world size suggests: whole nodes of 8 80 GB GPUs."""
    per_node = min(gpus_per_node, world_size)
    return Cluster(-(-world_size // per_node), per_node, gpu_mem)
