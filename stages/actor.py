"""StageActor: one pipeline stage, one device, one Ray actor.

Life of a stage:
  1. `probe(path)`      before any weight is loaded: the device (name, total/free bytes, node),
                         the measured ms per dense layer and per missed expert at the model's real
                         dimensions, and the file's size and sampled hash as this node sees it.
  2. `connect(...)`     join the stages' process group (activations go stage to stage over it).
  3. `load(...)`        load only layers [first, end) (+ embedding / head), allocate the KV cache.
  4. `step(batch)`      run one micro-batch through this stage's layers.

The class is plain Python; the driver wraps it with `ray.remote` when it spawns stages, so
unit tests can also drive it in-process.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from stages.device import DeviceInfo, DeviceMemory, measure_speed, probe_device


def file_fingerprint(path: str, n_samples: int = 16, block: int = 1 << 16) -> dict[str, Any]:
    """Size and a sampled sha256 (head, tail and evenly spaced blocks) of a file.

    A full hash of a 100 GB model would take minutes per node; sampled blocks catch a
    different file, a different quantisation, and a truncated or partial copy.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        offsets = sorted({0, max(0, size - block), *(i * size // n_samples for i in range(n_samples))})
        for off in offsets:
            f.seek(off)
            h.update(f.read(block))
    return {"size": size, "sha256_sampled": h.hexdigest()}


class StageActor:
    def __init__(self, stage: int, n_stages: int, simulated_budget: int | None = None,
                 torch_threads: int | None = None):
        import torch

        if torch_threads:
            # Simulated stages share the host's cores; without this each grabs all of them.
            torch.set_num_threads(torch_threads)
        self.stage, self.n_stages = stage, n_stages
        self.simulated_budget = simulated_budget
        self.device: DeviceInfo = probe_device(simulated_budget, index=stage)
        self.memory = DeviceMemory(self.device, stage)
        self.link = None
        self.model = None

    # ---------------------------------------------------------------- before loading

    def probe(self, path: str) -> dict[str, Any]:
        """Everything the planner needs from this stage, measured here, before any weight is loaded."""
        from stages.gguf_file import read_gguf_header

        header = read_gguf_header(path)
        t = time.perf_counter()
        speed = measure_speed(header, self.device.torch_device)
        self.device = probe_device(self.simulated_budget, index=self.stage)  # free memory now, after timing
        self.memory = DeviceMemory(self.device, self.stage)
        return {
            "stage": self.stage,
            "pid": os.getpid(),
            "device": self.device.to_dict(),
            "layer_ms": speed.layer_ms,
            "miss_ms": speed.miss_ms,
            "measure_s": time.perf_counter() - t,
            "file": file_fingerprint(path),
        }

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from stages.transport import free_port

        return free_port()

    # ---------------------------------------------------------------- wiring

    def connect(self, master_addr: str, master_port: int, timeout_s: float = 30.0) -> int:
        from stages.transport import StageLink

        backend = "nccl" if self.device.kind == "cuda" else "gloo"
        self.link = StageLink(master_addr, master_port, self.stage, self.n_stages, timeout_s, backend)
        return self.stage

    def ping(self) -> int:
        return os.getpid()

    # ---------------------------------------------------------------- transport micro-benchmarks

    def link_check(self, rows: int, hidden: int, reps: int) -> dict[str, Any]:
        """Pass a known [rows, hidden] float32 tensor down the pipeline `reps` times over the process
        group (every stage calls this at once). The last stage checks every copy arrived intact and
        reports the mean ms per pass: the transport cost of one step with this activation size."""
        import torch

        expected = torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden)
        intact = True
        t = time.perf_counter()
        for _ in range(reps):
            x = expected if self.link.is_first else self.link.recv(rows, hidden)
            if not self.link.is_last:
                self.link.send(x)
            else:
                intact = intact and bool(torch.equal(x, expected))
        return {"stage": self.stage, "ms_per_pass": (time.perf_counter() - t) * 1e3 / reps, "intact": intact}

    def relay(self, x, rest: list | None = None):
        """Ray-call chaining, for comparison: each stage hands x on by calling the next one."""
        import ray

        if not rest:
            return x
        return ray.get(rest[0].relay.remote(x, rest[1:]), timeout=30)
