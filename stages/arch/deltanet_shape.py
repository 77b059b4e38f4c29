"""The sizes of a Gated DeltaNet layer and of the state one sequence keeps in it.

Torch-free: configs (stages/arch/qwen3next.py), the planner and the driver price the state from
these numbers alone; stages/blocks/deltanet.py computes with them.
"""
from __future__ import annotations

from dataclasses import dataclass

V_ORDERS = ("grouped", "tiled")


@dataclass(frozen=True)
class DeltaNetShape:
    """One DeltaNet layer's sizes (llama.cpp: ssm.group_count = H_k, ssm.time_step_rank = H_v,
    ssm.state_size = D_k = D_v, ssm.inner_size = H_v·D_v, ssm.conv_kernel = K)."""
    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    v_order: str = "grouped"

    def __post_init__(self):
        if self.v_order not in V_ORDERS:
            raise ValueError(f"v_order {self.v_order!r}: one of {V_ORDERS}")
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"{self.n_v_heads} value heads are not a multiple of {self.n_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def rec_state_shape(self) -> tuple[int, int, int]:
        return (self.n_v_heads, self.head_k_dim, self.head_v_dim)

    def state_bytes(self) -> int:
        """float32 bytes of one sequence's state in one layer (conv + recurrent)."""
        c, r = self.conv_state_shape, self.rec_state_shape
        return 4 * (c[0] * c[1] + r[0] * r[1] * r[2])

    def expand_qk(self, x):
        """A tensor [..., H_k, D] -> [..., H_v, D]: the k head each v head reads, in the file's V order."""
        r = self.n_v_heads // self.n_k_heads
        if r == 1:
            return x
        if self.v_order == "grouped":
            return x.repeat_interleave(r, dim=-2)
        return x.repeat(*([1] * (x.dim() - 2)), r, 1)
