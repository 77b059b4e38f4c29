"""Errors a user can act on. Every message names the file or thing at fault and the fix.

Torch-free: the planner and the CLI import this without the model code.
"""
from __future__ import annotations


class MoerayError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class GGUFError(MoerayError, ValueError):
    """A GGUF file that moeray cannot use."""


class NotGGUFError(GGUFError):
    pass


class TruncatedGGUFError(GGUFError):
    pass


class UnsupportedArchitectureError(GGUFError):
    pass


class MissingTensorError(GGUFError):
    pass


class TensorShapeError(GGUFError):
    pass


class UnsupportedQuantError(GGUFError):
    pass


class ProfileError(MoerayError, ValueError):
    """A routing profile (moeray, Strata STRP or colibri heat file) that is corrupt or does not match the model."""


class PlacementError(MoerayError):
    """No placement of the model fits the devices."""


class ConfigError(MoerayError, ValueError):
    """A setting of the config tree (or the debugging override standing for it) that is not allowed."""

    def __init__(self, setting: str, value, why: str):
        super().__init__(f"{setting}={value!r}: {why}")
        self.setting, self.value, self.why = setting, value, why


class ModelPartsError(GGUFError):
    """A model in parts (llama.cpp's gguf-split) whose parts are missing, mixed or cut short."""
