"""Built-in machine descriptions, from published datasheet figures: plan for hardware before you rent
or buy it (``tiertrain plan --machine h100-sxm-80gb``).

The GPU figures are the datasheets' (each source beside it). What a datasheet does not give is
derived by stated rules, the same for every machine, so the descriptions compare:

- achieved matmul FLOP/s = ``MATMUL_EFFICIENCY`` x the dense (not sparse) peak: a large GEMM reaches
  about that fraction of peak (assumed; we had no GPU to calibrate on. This CPU's probe reaches its
  own measured rate, and ``tiertrain probe`` on a GPU measures it there);
- device memory bandwidth, host<->device copies: ``LINK_EFFICIENCY`` x the datasheet figure per
  direction (pinned copies reach about 80% of a PCIe link);
- host, disk and CPU per GPU: the vendor's reference server for that GPU divided by its GPUs (DGX
  H100/H200/A100/DGX-1 user guides), or a stated workstation for the RTX 4090;
- CPU AdamW parameters/s = ``ADAM_EFFICIENCY`` x the host memory bandwidth per GPU / 28 bytes (fused
  AdamW reads parameter, gradient and two moments and writes three: 28 bytes per parameter, and runs
  near the memory bandwidth: 1.0 G params/s at 22-30 GB/s STREAM on our CPU, BENCHMARKS.md);
- page size 4 MiB, the size the page-size probe picks on NVMe drives of this class.
"""

from __future__ import annotations

from pathlib import Path

from tiertrain.errors import ConfigError
from tiertrain.planner.machine import Link, Machine, PerDtype

GB, TB, GiB, MiB = 10**9, 10**12, 1 << 30, 1 << 20
TFLOPS = 1e12
MATMUL_EFFICIENCY = 0.7
LINK_EFFICIENCY = 0.8
MEMORY_EFFICIENCY = 0.9
ADAM_EFFICIENCY = 0.7
ADAM_BYTES_PER_PARAM = 28


def _gpu(name: str, memory: int, peak: PerDtype, hbm_bps: float, pcie_bps: float, host: int, disk: int,
         disk_read: float, disk_write: float, host_mem_bps: float, network: tuple[Link, ...], source: str) -> Machine:
    """A GPU machine from datasheet figures; ``pcie_bps`` per direction, ``host_mem_bps`` per GPU."""
    achieved = PerDtype(*(MATMUL_EFFICIENCY * r for r in (peak.fp32, peak.bf16, peak.fp16)))
    return Machine(name=name, device="cuda", device_memory=memory, host_memory=host, peak_flops=peak,
                   matmul_flops=achieved, memory_bps=MEMORY_EFFICIENCY * hbm_bps,
                   h2d_bps=LINK_EFFICIENCY * pcie_bps, d2h_bps=LINK_EFFICIENCY * pcie_bps,
                   disk_read_bps=disk_read, disk_write_bps=disk_write,
                   adam_params_per_s=ADAM_EFFICIENCY * host_mem_bps / ADAM_BYTES_PER_PARAM,
                   disk_bytes=disk, page_size=4 * MiB, network=network, source=source)


def _builtins() -> dict[str, Machine]:
    # Hopper host: DGX H100/H200 user guide: 2 TB DDR5 and 8 x 3.84 TB U.2 NVMe for 8 GPUs; 2 x Xeon
    # Platinum 8480C, 8 channels of DDR5-4800 each (614 GB/s in all). Drive: Samsung PM1733 3.84 TB
    # datasheet, 7.0 GB/s sequential read, 3.8 GB/s write. Network: 8 x ConnectX-7 400 Gb/s.
    hopper = dict(host=256 * GB, disk=int(3.84 * TB), disk_read=7.0 * GB, disk_write=3.8 * GB,
                  host_mem_bps=614 * GB / 8,
                  network=(Link("nvlink4", 450 * GB), Link("connectx7-400g", 50 * GB)))
    # Ampere host: DGX A100 user guide: 2 TB (80 GB GPUs) or 1 TB (40 GB GPUs) DDR4 and 15 TB of
    # U.2 NVMe (4 x 3.84 TB) for 8 GPUs; 2 x AMD EPYC 7742, 8 channels of DDR4-3200 each (410 GB/s).
    # Network: 8 x ConnectX-6 200 Gb/s.
    ampere = dict(disk=int(4 * 3.84 * TB / 8), disk_read=7.0 * GB, disk_write=3.8 * GB, host_mem_bps=410 * GB / 8,
                  network=(Link("nvlink3", 300 * GB), Link("connectx6-200g", 25 * GB)))
    machines = [
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TFLOPS, BF16/FP16 tensor 1,979 TFLOPS
        # with sparsity (989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (64 each way)
        _gpu("h100-sxm-80gb", 80 * GiB, PerDtype(67 * TFLOPS, 989 * TFLOPS, 989 * TFLOPS), 3.35 * TB, 64 * GB,
             **hopper, source="NVIDIA H100 datasheet (SXM5); host: DGX H100 per GPU"),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, BF16/FP16 tensor 1,979 TFLOPS with
        # sparsity (989 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s
        _gpu("h200", 141 * GiB, PerDtype(67 * TFLOPS, 989 * TFLOPS, 989 * TFLOPS), 4.8 * TB, 64 * GB,
             **hopper, source="NVIDIA H200 datasheet (SXM); host: DGX H200 per GPU"),
        # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16/FP16 tensor 312 TFLOPS
        # dense, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s (32 each way)
        _gpu("a100-80gb", 80 * GiB, PerDtype(19.5 * TFLOPS, 312 * TFLOPS, 312 * TFLOPS), 2039 * GB, 32 * GB,
             host=256 * GB, **ampere, source="NVIDIA A100 datasheet (SXM4 80GB); host: DGX A100 per GPU"),
        # the same datasheet, SXM4 40GB: 40 GB HBM2 at 1,555 GB/s; DGX A100 (40 GB) has 1 TB of RAM
        _gpu("a100-40gb", 40 * GiB, PerDtype(19.5 * TFLOPS, 312 * TFLOPS, 312 * TFLOPS), 1555 * GB, 32 * GB,
             host=128 * GB, **ampere, source="NVIDIA A100 datasheet (SXM4 40GB); host: DGX A100 per GPU"),
        # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: FP32 82.6 TFLOPS, FP16/BF16 tensor
        # with FP32 accumulate 165.2 TFLOPS dense, 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16 (32 GB/s each
        # way). Host assumed: a workstation with 128 GB of dual-channel DDR5-5600 (89.6 GB/s) and one
        # Samsung 990 PRO 2 TB (datasheet: 7.45 GB/s read, 6.9 GB/s write); 10 GbE.
        _gpu("rtx-4090", 24 * GiB, PerDtype(82.6 * TFLOPS, 165.2 * TFLOPS, 165.2 * TFLOPS), 1008 * GB, 32 * GB,
             host=128 * GB, disk=2 * TB, disk_read=7.45 * GB, disk_write=6.9 * GB, host_mem_bps=89.6 * GB,
             network=(Link("10gbe", 1.25 * GB),),
             source="NVIDIA Ada Lovelace whitepaper (RTX 4090); host: an assumed workstation"),
        # NVIDIA Tesla V100 datasheet (SXM2 32GB): FP32 15.7 TFLOPS, tensor (FP16) 125 TFLOPS, no BF16;
        # 32 GB HBM2 at 900 GB/s, NVLink 300 GB/s, PCIe Gen3 32 GB/s (16 each way). Host: DGX-1 user guide,
        # 512 GB DDR4 and 4 x 1.92 TB SSD for 8 GPUs; 2 x Xeon E5-2698 v4, 4 channels DDR4-2133 each
        # (137 GB/s); SATA SSDs at about 0.5 GB/s each, so 4 x 0.5 / 8 per GPU; 4 x IB EDR 100 Gb/s.
        _gpu("v100-32gb", 32 * GiB, PerDtype(15.7 * TFLOPS, 0.0, 125 * TFLOPS), 900 * GB, 16 * GB,
             host=64 * GB, disk=int(4 * 1.92 * TB / 8), disk_read=0.25 * GB, disk_write=0.25 * GB,
             host_mem_bps=137 * GB / 8, network=(Link("nvlink2", 150 * GB), Link("ib-edr", 6.25 * GB)),
             source="NVIDIA V100 datasheet (SXM2 32GB); host: DGX-1 per GPU"),
    ]
    return {m.name: m for m in machines}


BUILTIN: dict[str, Machine] = _builtins()


class UnknownMachine(ConfigError):
    """A --machine that is neither a built-in name nor a description file."""


def find_machine(name_or_file: str) -> Machine:
    """A built-in description by name, or a description file (``tiertrain probe --out`` writes one)."""
    if name_or_file in BUILTIN:
        return BUILTIN[name_or_file]
    path = Path(name_or_file)
    if path.suffix == ".json" or path.exists():
        return Machine.read(path)
    raise UnknownMachine(f"--machine {name_or_file!r} is neither a built-in machine ({', '.join(BUILTIN)}) nor a "
                         "description file; write this machine's with `tiertrain probe --out machine.json`")
