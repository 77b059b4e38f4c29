"""Stages in one process, without Ray: what the device check runs on a machine that has no Ray.

`InProcessPipeline` drives n StageActors (the class a Ray stage is, constructed here as a plain
object) in order, each on its layer range, with an in-memory link between neighbours in place of
the process group: a step runs stage 0's embed and layers, hands the activations to stage 1, and
so on; the last samples. Everything a stage does (probe, load with its ledger, the expert cache,
the KV pool, step) is the served code; only the transport differs. `link_hops` measures the real
transport (stages/transport.StageLink over gloo, the backend of stages sharing one card) between
two processes started with torch.multiprocessing, no Ray.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace


class MemoryLink:
    """StageLink's interface (send, recv, send_failure) over a queue shared with the neighbours."""

    backend = "in-process"

    def __init__(self, rank: int, world: int, queues: list[deque], compute_device):
        self.rank, self.world_size, self.queues = rank, world, queues
        self.compute_device = compute_device

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send(self, hidden, tokens: list[int] | None = None) -> None:
        self.queues[self.rank].append((hidden, list(tokens or ())))

    def send_failure(self, n_rows: int, hidden_size: int) -> None:
        self.queues[self.rank].append(None)

    def recv(self, n_rows: int, hidden_size: int, carried: bool = False):
        """As StageLink.recv: the activations, with the drafted tokens they carry when `carried`."""
        msg = self.queues[self.rank - 1].popleft()
        if msg is None:
            raise RuntimeError(f"stage {self.rank - 1} failed this step")
        x, tokens = msg
        if tuple(x.shape) != (n_rows, hidden_size):
            raise RuntimeError(f"stage {self.rank}: expected [{n_rows}, {hidden_size}], got {tuple(x.shape)}")
        x = x.to(self.compute_device)
        return (x, tokens) if carried else x


class InProcessPipeline:
    """The engine's pipeline (submit / result / recover) over StageActors in this process."""

    def __init__(self, stages, kv_blocks: int):
        self.stages, self.kv_blocks = stages, kv_blocks
        self.n_stages = 1  # steps run one after another here: the engine keeps one in flight
        queues = [deque() for _ in stages]
        for s in stages:
            s.link = MemoryLink(s.stage, len(stages), queues, s.device.torch_device)

    @classmethod
    def load(cls, path: str, n_stages: int, kv_blocks: int, simulated: list[int] | None, backend: str,
             card_share: float = 1.0) -> "InProcessPipeline":
        """n stages over the file's layers split evenly; each probes its device (`simulated` bytes
        each on the CPU, else `card_share` of the card) and loads as a Ray stage would."""
        from moeray.stages.kernels import settings
        from moeray.stages.runtime.actor import StageActor
        from moeray.stages.gguf.reader import read_gguf_header

        n_layers = read_gguf_header(path).config.n_layers
        cuts = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
        stages = []
        for i in range(n_stages):
            budget = None if simulated is None else simulated[i]
            s = StageActor(i, n_stages, budget, torch_threads=None, card_share=card_share,
                           options=replace(settings.current(), backend=backend))
            s.load(path, cuts[i], cuts[i + 1], kv_blocks)
            stages.append(s)
        return cls(stages, kv_blocks)

    def submit(self, batch):
        out = None
        for s in self.stages:
            out = s.step(batch)
        return out

    def result(self, handle, timeout_s: float):
        return handle

    def recover(self) -> None:
        for s in self.stages:
            s.link.queues[s.stage].clear()


def _hop_worker(rank: int, port: int, device: str, hidden: int, rows_list: list[int], reps: int, results) -> None:
    from carry import bootstrap

    bootstrap()  # a spawned process starts bare: moeray from the checkout again
    from moeray.stages.runtime.transport import StageLink

    link = StageLink("127.0.0.1", port, rank, 2, 60.0, "gloo", compute_device=device)
    import torch

    try:
        for rows in rows_list:
            expected = torch.arange(rows * hidden, dtype=torch.float32, device=device).reshape(rows, hidden)
            intact = True
            t = time.perf_counter()
            for _ in range(reps):
                if rank == 0:
                    link.send(expected)
                else:
                    intact = intact and bool(torch.equal(link.recv(rows, hidden), expected))
            if rank == 1:
                results[rows] = {"ms_per_hop": (time.perf_counter() - t) * 1e3 / reps, "intact": intact,
                                 "backend": link.backend, "device": device}
    finally:
        link.close()


def link_hops(device: str, hidden: int, rows_list=(1, 16), reps: int = 100) -> dict:
    """ms per hop of [rows, hidden] float32 activations between two processes over StageLink."""
    import torch.multiprocessing as mp

    from moeray.stages.runtime.transport import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_hop_worker, args=(free_port(), device, hidden, list(rows_list), reps, results), nprocs=2, join=True)
        return {f"rows{r}": dict(results[r]) for r in rows_list}
