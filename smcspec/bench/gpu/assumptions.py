"""The H200's figures and the costs nothing in the estimate measures (`gpu.costs`): one
frozen `Assumptions`, each field with its source (`SOURCES`), and the slow end of the ranges the
sources give (`SLOW_END`) for the targets table's pessimistic column."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Assumptions:
    """The H200's figures and the costs nothing here measures (seconds, bytes, counts)."""

    hbm_bytes_per_s: float = 4.3e12
    l2_bytes_per_s: float = 8.0e12
    bf16_flops: float = 7.8e14
    sms: int = 132
    ctas_per_sm: int = 9
    gemm_efficiency: float = 0.875
    kernel_s: float = 2.5e-6
    old_iteration_s: float = 1.7e-6
    new_iteration_s: float = 1.0e-6
    flat_sample_launches: int = 34
    chunked_sample_launches: int = 49
    scan_one_row_s: float = 1.0e-5
    scan_rows_s: float = 1.5e-4
    chunked_scan_s: float = 2.0e-5
    logit_passes: int = 15
    host_wait_s: float = 3.0e-4

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)!r}")
        if self.gemm_efficiency > 1:
            raise ValueError(f"gemm_efficiency must be at most 1, got {self.gemm_efficiency}")


# The slow end of each range the sources give (ASSUMED values: twice the value), for the
# targets table's pessimistic column; the rest stay as they are.
SLOW_END = {
    "gemm_efficiency": 0.85,
    "kernel_s": 3.0e-6,
    "new_iteration_s": 2.0e-6,
    "scan_one_row_s": 2.0e-5,
    "scan_rows_s": 2.0e-4,
    "chunked_scan_s": 4.0e-5,
    "host_wait_s": 6.0e-4,
}


def slow_end(a: Assumptions) -> Assumptions:
    return replace(a, **SLOW_END)


PREFLIGHT = "the GPU pre-flight review of the CUDA path"
SOURCES = {
    "hbm_bytes_per_s": "HBM read bandwidth: a device-to-device copy moved 4.3 TB/s counting "
    "bytes read and written on an H200 of this project's device pool (its notes, 2026-10-28 "
    "and 11-04); a read-only stream runs at about the same (datasheet 4.8 TB/s)",
    "l2_bytes_per_s": f"L2 bandwidth the old kernel's re-reads are served at ({PREFLIGHT})",
    "bf16_flops": "dense bf16 matrix rate: 769-798 TFLOP/s measured on random data on an "
    "H200 of the device pool (its notes); only binds for wide verifies",
    "sms": "multiprocessors of the H200 (PyTorch's report on the device)",
    "ctas_per_sm": f"programs resident per SM: 56 registers x 128 threads ({PREFLIGHT}, the "
    "sm_90 compile of the old kernel); the new kernel's few hundred programs fit one wave at "
    "any occupancy >= 2",
    "gemm_efficiency": f"share of HBM bandwidth cuBLAS reaches streaming bf16 weights at <= 150 "
    f"rows: 85-90% ({PREFLIGHT})",
    "kernel_s": f"fixed cost of one kernel inside a CUDA graph (gap, fill and drain): 2-3 us "
    f"({PREFLIGHT}, finding 2); charged to every kernel, weight-streaming ones too",
    "old_iteration_s": f"one key block of the old kernel: three dependent global loads and ~6 "
    f"barriers, no pipelining, read off its sm_90 SASS ({PREFLIGHT}, finding 1)",
    "new_iteration_s": "one key block of the new split-KV kernel: one pipelined round trip "
    "(num_stages) and two tl.dot; ASSUMED, to be measured with do_bench on the device",
    "flat_sample_launches": "kernel-launching ops of one sampling call (law + sample, one "
    "float64 scan of the row) on the CUDA branch: 40 aten ops, 6 of them views, counted on the "
    "meta device at commit b5936c1",
    "chunked_sample_launches": "the same for the two-level sampler (law + sample_at, chunks of "
    "~sqrt(V)): counted on the meta device at commit a6a70a8 (views and allocations not "
    "counted, as launches.count_ops)",
    "scan_one_row_s": "float64 CDF scan of one row of 152k logits (CUB's device scan): ASSUMED",
    "scan_rows_s": f"float64 CDF scan at >= 2 rows, one 512-thread block a row: 0.1-0.2 ms "
    f"({PREFLIGHT}, finding 6)",
    "chunked_scan_s": "the two-level sampler's scans (a chunk sum and scan over ~390 chunks, "
    "then one chunk of ~390 tokens): ASSUMED a few us each",
    "logit_passes": f"elementwise passes over the float32 logits per sampling call (temper, "
    f"log_softmax, nan_to_num, ...): about 15 ({PREFLIGHT}, finding 14)",
    "host_wait_s": f"GPU idle per host wait (blocking copy, then the host loads and launches the "
    f"next graph): 0.3-0.6 ms, low end taken ({PREFLIGHT}, finding 5)",
}
