"""What the planner needs to know about a model: sizes, not weights."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moeray.errors import PlacementError


@dataclass
class TrunkBytes:
    embedding: int = 0  # token embedding: stage 0
    head: int = 0  # output norm + lm_head: the last stage
    layers: list[int] = field(default_factory=list)  # per layer: attention, norms, router, shared expert
    # Optional, per layer: the named pieces of `layers[l]` with their bytes (e.g. "dnproj", the
    # fused DeltaNet projections of a hybrid layer), printed with the layer's [place] decision.
    pieces: list[dict[str, int]] = field(default_factory=list)


@dataclass
class ModelSpec:
    n_layers: int
    n_experts: int
    n_experts_used: int  # k: experts routed per token per layer
    expert_bytes: list[int]  # bytes of one routed expert of each layer, as stored in a slot; 0: a dense layer
    trunk_bytes: TrunkBytes
    # Bytes one sequence's recurrent state takes in each layer (DeltaNet layers; 0 elsewhere):
    # held on the layer's card for every sequence that may run, so charged like its KV.
    state_bytes: list[int] = field(default_factory=list)
    # Bytes one token's KV takes in each layer, as the stages hold it (16-bit on cards): the
    # architecture's layout (GQA: k and v of every KV head; MLA: the latent + rope key).
    kv_token_bytes: list[int] = field(default_factory=list)

    def __post_init__(self):
        L = self.n_layers
        if L <= 0 or self.n_experts <= 0 or not 0 < self.n_experts_used <= self.n_experts:
            raise PlacementError(f"model spec: need n_layers > 0, n_experts > 0 and 0 < k <= n_experts "
                                 f"(got {L}, {self.n_experts}, {self.n_experts_used})")
        if len(self.expert_bytes) != L:
            raise PlacementError(f"model spec: expert_bytes has {len(self.expert_bytes)} entries for {L} layers")
        if any(b < 0 for b in self.expert_bytes) or not any(self.expert_bytes):
            raise PlacementError("model spec: expert_bytes must be >= 0 per layer (0: a dense layer) with at least "
                                 "one MoE layer > 0 (the planner places routed experts)")
        if not self.trunk_bytes.layers:
            self.trunk_bytes.layers = [0] * L
        if len(self.trunk_bytes.layers) != L:
            raise PlacementError(f"model spec: trunk_bytes.layers has {len(self.trunk_bytes.layers)} "
                                 f"entries for {L} layers")
        pieces = self.trunk_bytes.pieces
        if pieces and (len(pieces) != L or any(sum(p.values()) != t for p, t in zip(pieces, self.trunk_bytes.layers))):
            raise PlacementError("model spec: trunk_bytes.pieces needs one entry per layer, each summing to that "
                                 "layer's trunk_bytes.layers")
        if not self.state_bytes:
            self.state_bytes = [0] * L
        if len(self.state_bytes) != L:
            raise PlacementError(f"model spec: state_bytes has {len(self.state_bytes)} entries for {L} layers")
        if not self.kv_token_bytes:
            self.kv_token_bytes = [0] * L
        if len(self.kv_token_bytes) != L:
            raise PlacementError(f"model spec: kv_token_bytes has {len(self.kv_token_bytes)} entries for {L} layers")

    @property
    def moe_layers(self) -> list[int]:
        """Layers with routed experts; the others (expert_bytes 0: DeepSeek's first 3, GLM's first)
        are dense, priced as trunk only, with no slots and no profile pairs."""
        return [l for l, b in enumerate(self.expert_bytes) if b > 0]

    def with_state_for(self, n_seqs: int) -> "ModelSpec":
        """The spec with `n_seqs` sequences' recurrent state charged to each layer's trunk, as a
        layer's KV is: every sequence that may run holds its state on the layer's card."""
        if not any(self.state_bytes):
            return self
        tb = self.trunk_bytes
        layers = [t + n_seqs * s for t, s in zip(tb.layers, self.state_bytes)]
        pieces = [dict(p, state=n_seqs * s) if s else dict(p) for p, s in zip(tb.pieces, self.state_bytes)]
        return ModelSpec(self.n_layers, self.n_experts, self.n_experts_used, list(self.expert_bytes),
                         TrunkBytes(tb.embedding, tb.head, layers, pieces), list(self.state_bytes),
                         list(self.kv_token_bytes))

    def with_kv_for(self, n_tokens: int) -> "ModelSpec":
        """The spec with `n_tokens` tokens of KV charged to each layer's trunk (a layer's KV pool
        is on its card whatever the split, as the driver prices it)."""
        if not n_tokens or not any(self.kv_token_bytes):
            return self
        tb = self.trunk_bytes
        layers = [t + n_tokens * k for t, k in zip(tb.layers, self.kv_token_bytes)]
        pieces = [dict(p, kv=n_tokens * k) for p, k in zip(tb.pieces, self.kv_token_bytes)]
        return ModelSpec(self.n_layers, self.n_experts, self.n_experts_used, list(self.expert_bytes),
                         TrunkBytes(tb.embedding, tb.head, layers, pieces), list(self.state_bytes),
                         list(self.kv_token_bytes))

    @classmethod
    def from_dict(cls, d: dict, where: str = "spec") -> "ModelSpec":
        try:
            tb = d.get("trunk_bytes") or {}
            return cls(
                n_layers=int(d["n_layers"]), n_experts=int(d["n_experts"]),
                n_experts_used=int(d["n_experts_used"]),
                expert_bytes=[int(x) for x in d["expert_bytes"]],
                trunk_bytes=TrunkBytes(int(tb.get("embedding", 0)), int(tb.get("head", 0)),
                                       [int(x) for x in tb.get("layers", [])],
                                       [{str(k): int(v) for k, v in p.items()} for p in tb.get("pieces", [])]),
                state_bytes=[int(x) for x in d.get("state_bytes", [])],
                kv_token_bytes=[int(x) for x in d.get("kv_token_bytes", [])])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlacementError(f"{where}: malformed model spec ({exc!r}); expected {{\"n_layers\", "
                                 "\"n_experts\", \"n_experts_used\", \"expert_bytes\": [...], "
                                 "\"trunk_bytes\": {\"embedding\", \"head\", \"layers\": [...]}}") from None

    @classmethod
    def from_json(cls, path) -> "ModelSpec":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlacementError(f"cannot read model spec {path}: {exc}") from None
        return cls.from_dict(d, where=str(path))

    def to_dict(self) -> dict:
        return {"n_layers": self.n_layers, "n_experts": self.n_experts,
                "n_experts_used": self.n_experts_used, "expert_bytes": list(self.expert_bytes),
                "trunk_bytes": {"embedding": self.trunk_bytes.embedding, "head": self.trunk_bytes.head,
                                "layers": list(self.trunk_bytes.layers),
                                **({"pieces": self.trunk_bytes.pieces} if self.trunk_bytes.pieces else {})},
                **({"state_bytes": list(self.state_bytes)} if any(self.state_bytes) else {}),
                **({"kv_token_bytes": list(self.kv_token_bytes)} if any(self.kv_token_bytes) else {})}
