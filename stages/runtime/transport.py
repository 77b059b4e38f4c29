"""Activations from one stage to the next: a torch.distributed process group among the stage actors.

Why not Ray calls: chaining actor calls (stage i returns, the driver or stage i calls
stage i+1) costs ~1.5 ms per hop on this machine, and a decode step has a hop per stage.
A gloo process group (NCCL on GPU) sends the [tokens, hidden] tensor point to point for
~0.1 ms, the path vLLM's Ray executor settled on. bench/pipeline.py measures both.

Every message carries one extra leading row, the status row: element 0 is 0 for activations
and 1 for "the step failed upstream"; element 1 counts the token ids that follow it in the row
(a draft model's tokens, drafted on the first stage and verified on the last: exact in float32
below 2**24, far past any vocabulary). A stage whose step raised still sends a status row, so
the stages after it fail the same step at once instead of waiting for a tensor that never
comes. Every wait is bounded by the group's timeout.

A chained decode step (cluster/engine.py) closes the ring: the last stage sends its sampled token
ids to the first stage (int64, on the host), which takes them at its next step, so a stream's
next token does not wait for the driver.

On CUDA the wire and the compute device can differ: NCCL moves CUDA tensors card to card, but
refuses two ranks on one card (stages sharing a GPU through fractional Ray resources), so such a
group runs gloo over host memory: the sender copies its activations to the host, the receiver
gets them in pinned memory and hands them to its card with one asynchronous copy.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from moeray.errors import MoerayError

OK, FAILED = 0.0, 1.0


class TransportError(MoerayError):
    """The link between two stages broke (a peer died, timed out, or failed a step upstream)."""


def link_backend(devices: list[tuple[str, str, str]]) -> str:
    """The backend for stages on these devices, each (kind, node id, PCI bus id): NCCL when every
    stage has a CUDA card of its own, gloo when any stage is not on CUDA or two share a card
    (NCCL refuses two ranks on one device)."""
    if not devices or any(kind != "cuda" for kind, _node, _bus in devices):
        return "gloo"
    cards = [(node, bus) for _kind, node, bus in devices]
    return "nccl" if len(set(cards)) == len(cards) else "gloo"


def free_port(host: str = "") -> int:
    """A TCP port free on this node now (the OS picks it; the group binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StageLink:
    """One stage's end of the pipeline: receive from stage rank-1, send to stage rank+1."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = 30.0, backend: str = "gloo", compute_device: str | torch.device = "cpu"):
        self.rank, self.world_size = rank, world_size
        self.backend = backend
        # Where the stage computes (what recv returns on) and where messages travel (the wire).
        self.compute_device = torch.device(compute_device)
        if self.compute_device.type == "cuda" and self.compute_device.index is None:
            self.compute_device = torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl" and self.compute_device.type != "cuda":
            raise MoerayError(f"stage {rank}: the nccl backend links CUDA stages; this stage computes on "
                              f"{self.compute_device}")
        self.device = self.compute_device if backend == "nccl" else torch.device("cpu")
        self._tokens, self._tokens_work = None, None  # the last stage's loop-back send in flight
        # A host message bound for a card lands in pinned memory, so the copy up is asynchronous.
        self._pin = self.device.type == "cpu" and self.compute_device.type == "cuda"
        if dist.is_initialized():  # a restart re-forms the group: leave the broken one first
            dist.destroy_process_group()
        dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send(self, hidden: torch.Tensor, tokens: list[int] | None = None) -> None:
        """Send activations [n, hidden] (float32) to the next stage, with `tokens` in the status row."""
        msg = torch.empty(hidden.shape[0] + 1, hidden.shape[1], dtype=torch.float32, device=self.device)
        msg[0].zero_()
        if tokens:
            if len(tokens) + 2 > hidden.shape[1]:
                raise MoerayError(f"stage {self.rank}: {len(tokens)} drafted tokens do not fit a status row of "
                                  f"{hidden.shape[1]} values; lower --max-draft or --token-budget")
            msg[0, 1] = len(tokens)
            msg[0, 2:2 + len(tokens)] = torch.tensor(tokens, dtype=torch.float32)
        msg[1:].copy_(hidden)
        self._send(msg)

    def send_failure(self, n_rows: int, hidden_size: int) -> None:
        """Tell the next stage this step failed (it must still receive a message of the agreed shape)."""
        msg = torch.zeros(n_rows + 1, hidden_size, dtype=torch.float32, device=self.device)
        msg[0, 0] = FAILED
        self._send(msg)

    def recv(self, n_rows: int, hidden_size: int, carried: bool = False):
        """Receive [n_rows, hidden] from the previous stage, on this stage's compute device;
        TransportError if it failed upstream. carried: (activations, the status row's token ids)."""
        msg = torch.empty(n_rows + 1, hidden_size, dtype=torch.float32, device=self.device, pin_memory=self._pin)
        try:
            dist.recv(msg, src=self.rank - 1)
        except Exception as exc:  # gloo raises RuntimeError on a dead peer or timeout
            raise TransportError(f"stage {self.rank}: receiving from stage {self.rank - 1} failed: {exc}") from exc
        if msg[0, 0].item() != OK:
            raise TransportError(f"stage {self.rank}: stage {self.rank - 1} or one before it failed this step")
        x = msg[1:].to(self.compute_device, non_blocking=True) if self.device != self.compute_device else msg[1:]
        if not carried:
            return x
        n = int(msg[0, 1].item())
        return x, [int(t) for t in msg[0, 2:2 + n].tolist()] if n else []

    def send_tokens(self, tokens: list[int]) -> None:
        """The last stage's sampled tokens to the first stage (a chained decode step's), without
        waiting for the first stage to take them: it does so at its next step, which may not be
        issued yet. The send before is finished first (the first stage has taken it by then: it
        took it before the step whose sampling sends these)."""
        self.wait_tokens()
        self._tokens = torch.tensor(tokens, dtype=torch.int64)
        try:
            self._tokens_work = dist.isend(self._tokens, dst=0)
        except Exception as exc:
            raise TransportError(f"stage {self.rank}: sending tokens to stage 0 failed: {exc}") from exc

    def wait_tokens(self) -> None:
        work, self._tokens_work = self._tokens_work, None
        if work is not None:
            try:
                work.wait()
            except Exception as exc:
                raise TransportError(f"stage {self.rank}: stage 0 did not take the tokens sent to it: {exc}") from exc

    def recv_tokens(self, n: int) -> list[int]:
        """At the first stage: the last stage's `n` sampled tokens of the step before."""
        msg = torch.empty(n, dtype=torch.int64)
        try:
            dist.recv(msg, src=self.world_size - 1)
        except Exception as exc:
            raise TransportError(f"stage {self.rank}: receiving tokens from stage {self.world_size - 1} failed: "
                                 f"{exc}") from exc
        return msg.tolist()

    def _send(self, msg: torch.Tensor) -> None:
        try:
            dist.send(msg, dst=self.rank + 1)
        except Exception as exc:
            raise TransportError(f"stage {self.rank}: sending to stage {self.rank + 1} failed: {exc}") from exc

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
