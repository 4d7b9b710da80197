"""Calibrating mixture-of-experts layers: per-expert token counts and the starved-expert policy.

An expert's Linears see only the tokens the router sends them (``compiler/model/moe.py``), so
the collector's statistics of them are per expert, and ``InputStatistics.tokens`` is how many
calibration tokens that expert received. An expert that received fewer than
``min_expert_tokens`` is *starved*: its mean |x| and XᵀX would be estimated from too few tokens
(none at all, for an expert the router never picks on the calibration text). Each pass then
applies its recorded policy, named in the expert's report rows, never silently:

- ``"all_tokens"`` (both passes): re-collect the expert's statistics with every token of its
  layer routed to it (``every_token_to``), as llm-compressor's ``calibrate_all_experts`` does; the
  router's top-k would not send them, but they are the inputs the expert's layer sees.
- ``"rtn"`` (AWQ): round-to-nearest INT4, no scale search, clipping or GPTQ rounding.
- ``"float"`` (FP8): the expert's Linears stay in float.
"""
from __future__ import annotations

import re

from compiler.pipeline.calibration import InputStatistics

_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.[^.]+$")


def expert_of(name: str) -> tuple[str, int] | None:
    """('layers.0.mlp', 3) for 'layers.0.mlp.experts.3.up_proj' (the MoE module, the expert); None
    for a Linear that is no expert's."""
    m = _EXPERT.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else None


def starved_linears(stats: dict[str, InputStatistics], names: list[str], min_tokens: int) -> list[str]:
    """The expert Linears of ``names`` whose statistics hold fewer than ``min_tokens`` tokens."""
    return [n for n in names if expert_of(n) is not None and stats[n].tokens < min_tokens]


def experts_of(names: list[str], prefix: str = "") -> dict[str, set[int]]:
    """{MoE module name (less ``prefix``): the experts ``names`` belong to}."""
    out: dict[str, set[int]] = {}
    for n in names:
        moe, e = expert_of(n)
        out.setdefault(moe.removeprefix(prefix), set()).add(e)
    return out


def starved_reason(routed: int, layer_tokens: int, min_tokens: int, policy: str) -> str:
    """The report's reason for a starved expert's Linear under ``policy``."""
    what = {"all_tokens": f"calibrated on all {layer_tokens} tokens of its layer",
            "rtn": "round-to-nearest, no scale search, clipping or GPTQ rounding",
            "float": "kept in float"}[policy]
    return (f"expert routed {routed} of {layer_tokens} calibration tokens (< min_expert_tokens {min_tokens}): "
            f"{what} (starved_experts = {policy!r})")
