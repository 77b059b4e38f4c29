"""The one byte ledger: what a device holds, by name, enforced byte for byte.

A stage's device memory (KV cache, trunk, expert cache) and the expert cache inside it are both
ByteBudgets. On CUDA a stage's capacity is what the device reports free (minus a reserve for
activations and the allocator's slack); on CPU it is a number the user gives, so the same code,
fill and numbers run on a machine without a GPU. Every slot filled charges the bytes its tensors
really hold and every eviction releases them; a charge that would pass the capacity raises
instead of happening, naming what asked and what is already there, so "the budget is never
exceeded" is a property of the code, not of the caller.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeray.errors import MoerayError
from moeray.units import format_bytes


class BudgetExceededError(MoerayError):
    """A charge that would put more bytes on the device than its budget allows."""


@dataclass
class ByteBudget:
    capacity: int
    device: str = "cpu"  # who is charged, for messages: "stage 2 (simulated 12.00 GiB)", "cuda:0"
    used: int = 0
    peak: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # bytes held, by what holds them

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"budget capacity must be >= 0, got {self.capacity}")

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def fits(self, n_bytes: int) -> bool:
        return self.used + n_bytes <= self.capacity

    def charge(self, n_bytes: int, what: str = "expert slots") -> None:
        n_bytes = int(n_bytes)
        if n_bytes < 0:
            raise ValueError("charge must be >= 0")
        if self.used + n_bytes > self.capacity:
            placed = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v) or "nothing"
            raise BudgetExceededError(
                f"{self.device}: {what} needs {format_bytes(n_bytes)} but only {format_bytes(self.free)} is left "
                f"of {format_bytes(self.capacity)} (already placed: {placed})")
        self.used += n_bytes
        self.peak = max(self.peak, self.used)
        self.parts[what] = self.parts.get(what, 0) + n_bytes

    def release(self, n_bytes: int, what: str = "expert slots") -> None:
        if n_bytes < 0 or n_bytes > self.parts.get(what, 0):
            raise ValueError(f"release of {n_bytes} bytes of {what} with {self.parts.get(what, 0)} held")
        self.used -= n_bytes
        self.parts[what] -= n_bytes


def device_budget(device: str, budget_bytes: int | None = None, reserve_bytes: int = 512 << 20) -> ByteBudget:
    """The budget for `device`: `budget_bytes` if given (a simulated budget on CPU, or a cap on
    CUDA), else on CUDA what the device has free now minus `reserve_bytes`. A negative budget (a
    stage whose KV and trunk already take more than its share) is an empty cache, not an error."""
    if budget_bytes is not None:
        budget_bytes = max(0, int(budget_bytes))
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        real = max(0, free - reserve_bytes)
        cap = real if budget_bytes is None else min(int(budget_bytes), real)
        return ByteBudget(cap, device)
    if budget_bytes is None:
        raise MoerayError(f"device {device!r} has no VRAM to measure: give the expert budget in bytes")
    return ByteBudget(int(budget_bytes), device)
