"""Quantized linear modules: the base class and the registry of storage formats.

A pass swaps an ``nn.Linear`` for a ``QuantizedLinear`` subclass with the same ``forward``.
The module's packed tensors are its buffers, so they land in the artifact's safetensors under
the module's name; ``format_meta()`` goes into the manifest and is enough, with the layer's
shape, to rebuild an empty module that the stored tensors are then assigned into. Each format
documents its buffers where it is defined (and in docs/FORMATS.md).
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn

from compiler.errors import ArtifactError


class QuantizedLinear(nn.Module):
    format_name: ClassVar[str]

    in_features: int
    out_features: int

    def format_meta(self) -> dict:
        """The manifest entry for this module; must include ``"format"``."""
        raise NotImplementedError

    @classmethod
    def empty(cls, meta: dict, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> "QuantizedLinear":
        """A module with correctly shaped (uninitialised) buffers, for loading from an artifact."""
        raise NotImplementedError

    @property
    def quantizes_activations(self) -> bool:
        """Whether ``forward`` also rounds its input (e.g. FP8 activations); False: weight-only."""
        return False

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the float matrix [out_features, in_features] it stands for."""
        raise NotImplementedError

    def dequantized_bias(self) -> torch.Tensor | None:
        """The bias that goes with ``dequantized_weight()`` in a float layer (formats that shift
        their inputs fold the shift into it)."""
        return getattr(self, "bias", None)


LINEAR_FORMATS: dict[str, type[QuantizedLinear]] = {}


def register_format(cls: type[QuantizedLinear]) -> type[QuantizedLinear]:
    LINEAR_FORMATS[cls.format_name] = cls
    return cls


def format_class(name: str) -> type[QuantizedLinear]:
    if name not in LINEAR_FORMATS:
        raise ArtifactError(f"artifact uses weight format {name!r}, which this qcompile does not know; upgrade qcompile")
    return LINEAR_FORMATS[name]


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """Every float ``nn.Linear`` by qualified name (the candidates a pass may convert)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
