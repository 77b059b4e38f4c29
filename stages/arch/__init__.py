"""Model families: what each architecture is (GGUF keys, tensor names, layer kinds, routing rule),
one module each, and the ModelConfig they fill. Imports nothing else of stages/.

Each module `stages/arch/<name>.py` defines `ARCH`, an `Architecture` (stages/arch/base.py);
adding a family is adding its module, nothing else registers it. Everything outside this
package asks `get_arch(name)` / `arch_of(cfg)` instead of testing the architecture's name.

Torch-free, like the configs and tensor tables it builds.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from moeray.errors import UnsupportedArchitectureError
from moeray.stages.arch.base import Architecture
from moeray.stages.arch.config import ModelConfig

_REGISTRY: dict[str, Architecture] | None = None


def _registry() -> dict[str, Architecture]:
    global _REGISTRY
    if _REGISTRY is None:
        found = {}
        for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if m.name == "base":
                continue
            arch = getattr(importlib.import_module(f"{__name__}.{m.name}"), "ARCH", None)
            if isinstance(arch, Architecture):
                found[arch.name] = arch
        _REGISTRY = found
    return _REGISTRY


def supported() -> tuple[str, ...]:
    """The GGUF `general.architecture` names moeray runs, sorted."""
    return tuple(sorted(_registry()))


def get_arch(name: Any, path: str = "<gguf>") -> Architecture:
    arch = _registry().get(name)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{path}: architecture '{name}' is not supported; moeray runs {', '.join(supported())} "
            "(llama with ffn_gate_inp/ffn_*_exps tensors is Mixtral-style MoE)")
    return arch


def arch_of(cfg: ModelConfig) -> Architecture:
    return get_arch(cfg.arch)


def config_from_metadata(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                         path: str = "<gguf>") -> ModelConfig:
    """Build the config from metadata plus the tensor directory (shapes settle vocab size and tying)."""
    return get_arch(meta.get("general.architecture"), path).config(meta, tensor_shapes, path)


def by_hf_class(config: Any) -> Architecture:
    """The architecture llama.cpp's converter writes a transformers config as (stages/gguf/writer.py)."""
    archs = getattr(config, "architectures", None) or []
    for arch in _registry().values():
        if any(a in arch.hf_classes for a in archs):
            return arch
    for arch in _registry().values():
        if config.model_type in arch.hf_model_types:
            return arch
    known = [c for a in _registry().values() for c in a.hf_classes]
    raise ValueError(f"cannot write {config.model_type!r} ({archs}) to GGUF; supported: {', '.join(known)}")
