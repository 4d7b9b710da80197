"""The ``rotate`` pass: an orthogonal rotation of the residual stream folded into the weights (QuaRot's
R1, Ashkboos et al., 2024; SpinQuant's R1 with a fixed rather than learned rotation), so that the
Linears reading the stream see inputs without outlier channels. The float model computes the same
function; a quantizing pass after it (``int8``'s per-token activations most) loses less.

    [[passes]]
    name = "rotate"
    rotation = "hadamard"   # a randomized Hadamard matrix, or "orthogonal": a random one (QR of a Gaussian)
    seed = 0

With Q orthogonal, RMSNorm(h Q) = RMSNorm(h) Q once the norm's weight is folded into the Linears it
feeds, so the whole residual stream can live in the rotated basis h Q:

1. fold each norm's weight into its readers (q/k/v, gate/up, lm_head: W diag(g)) and set it to ones;
2. embeddings E Q; each reader W Q; each writer (o_proj, down_proj) Qᵀ W and its bias b Q;
3. a tied lm_head becomes a copy of its own (it reads the rotated stream through the final norm's
   weight, the embedding does not), and the config says so: every export writes it.

"hadamard" is the Kronecker product of a Hadamard matrix of the width's largest power-of-two factor
with a random orthogonal matrix of the rest (SmolLM2's 576 = 64 × 9), its rows' signs random: one
channel's outlier lands on every channel, with equal magnitude within each block of 64 (a random
rotation spreads it only on average).

Not handled, refused before any work: Gemma's sandwich norms (a norm on each writer's output, whose
weight does not commute with Q), norms with a weight offset, mixture-of-experts and latent attention.
It must run before any pass that converts layers: those hold weights it cannot rotate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from compiler.errors import ConfigError
from compiler.model.transformer import Transformer
from compiler.pipeline import UNCONVERTED, Pass, PassContext, PassReport, register_pass


@dataclass
class RotateOptions:
    rotation: Literal["hadamard", "orthogonal"] = "hadamard"
    seed: int = 0


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order n (a power of two), scaled to be orthogonal; float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """Haar-distributed orthogonal matrix of order n (QR of a Gaussian, signs fixed by R's diagonal); float64."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotation_matrix(dim: int, kind: str, seed: int) -> torch.Tensor:
    """The [dim, dim] orthogonal matrix of ``RotateOptions``; float64."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "orthogonal":
        return random_orthogonal(dim, generator)
    power_of_two = dim & -dim
    rest = random_orthogonal(dim // power_of_two, generator)
    signs = torch.randint(0, 2, (dim, 1), generator=generator, dtype=torch.float64) * 2 - 1
    return signs * torch.kron(rest.contiguous(), hadamard(power_of_two))


@torch.no_grad()
def rotate_residual(model: Transformer, q: torch.Tensor) -> None:
    """Fold the norms' weights into their readers, then rotate the residual stream by ``q`` (see the
    module docstring); in place, each product in float64 and stored in the weight's dtype."""

    def store(param: torch.Tensor, value: torch.Tensor) -> None:
        param.data = value.to(param.dtype)

    def reads(linear: nn.Linear, gain: torch.Tensor) -> None:
        store(linear.weight, (linear.weight.double() * gain.double()) @ q)

    def writes(linear: nn.Linear) -> None:
        store(linear.weight, q.T @ linear.weight.double())
        if linear.bias is not None:
            store(linear.bias, linear.bias.double() @ q)

    model.untie_lm_head()
    model.config.tie_embeddings = False
    store(model.embed_tokens.weight, model.embed_tokens.weight.double() @ q)
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.ffn
        for norm, readers in ((layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj)),
                              (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            for linear in readers:
                reads(linear, norm.weight)
            norm.weight.data.fill_(1.0)
        writes(attention.o_proj)
        writes(mlp.down_proj)
    reads(model.lm_head, model.norm.weight)
    model.norm.weight.data.fill_(1.0)


def unrotatable(model: Transformer) -> str | None:
    """Why this pass cannot rotate ``model``'s residual stream, or None."""
    spec = model.config.spec
    if spec.sandwich_norms:
        return "normalises each sub-block's output before the residual add (sandwich norms), which a rotation does not pass"
    if spec.norm_weight_offset:
        return "multiplies its norms by (offset + weight)"
    if spec.is_moe or spec.attention != "gqa":
        return "has mixture-of-experts or latent-attention layers, which this pass does not handle"
    return None


@register_pass
class RotatePass(Pass):
    """A random orthogonal rotation of the residual stream, folded into the weights (module docstring)."""

    name = "rotate"
    Options = RotateOptions
    requires = frozenset({UNCONVERTED})

    def check(self, model: Transformer) -> None:
        if why := unrotatable(model):
            raise ConfigError(f"rotate: {model.config.architecture} {why}; leave the rotate pass out for it")

    def run(self, model: Transformer, context: PassContext) -> PassReport:
        o: RotateOptions = self.options
        tied = model.config.tie_embeddings
        rotate_residual(model, rotation_matrix(model.config.dim, o.rotation, o.seed))
        report = PassReport(self.name)
        report.metrics = {"rotation": o.rotation, "seed": o.seed, "dim": model.config.dim}
        if tied:
            report.notes.append("lm_head untied from the embeddings (the rotation folds the final norm into it alone)")
        return report
