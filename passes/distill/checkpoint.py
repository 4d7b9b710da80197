"""Full-state training checkpoints: safetensors for tensors, JSON for the rest (nothing is unpickled).

    checkpoints/step-000050/
      model.safetensors      the trained module's full state (student and hidden-state projections)
      optimizer.safetensors  AdamW moments per parameter (``{fqn}::{key}``) and the torch RNG state(s)
      state.json             step, skip counters, tokens seen, data position, scheduler, scaler,
                             optimizer param groups, python/numpy RNG states, the options

Each checkpoint directory is written to a hidden temp directory and renamed into place
(``compiler.io.atomic.atomic_directory_write``), so a crash never leaves a half-written one that
looks complete; after a save only the newest ``keep`` are kept.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from compiler.errors import CheckpointError
from compiler.io.atomic import atomic_directory_write

STEP_DIR = re.compile(r"^step-(\d{6,})$")
SEP = "::"


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON-able python/numpy RNG states, torch RNG state tensors)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    json_part = {"python": [version, list(py_state), gauss_next],
                 "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    return json_part, tensors


def set_rng_state(json_part: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, py_state, gauss_next = json_part["python"]
    random.setstate((version, tuple(py_state), gauss_next))
    kind, keys, pos, has_gauss, cached = json_part["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _flatten_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state keyed by parameter name -> flat tensors, and its JSON-able param groups."""
    tensors = {}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            tensors[f"{fqn}{SEP}{key}"] = torch.as_tensor(value).detach().cpu().clone().contiguous()
    return tensors, osd["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], param_groups: list[dict]) -> dict:
    state: dict[str, dict] = {}
    for name, t in tensors.items():
        if name.startswith("rng."):
            continue
        fqn, key = name.split(SEP)
        state.setdefault(fqn, {})[key] = t
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(root: Path, step: int, model_state: dict, optim_state: dict, state: dict, keep: int) -> Path:
    """Write ``root/step-NNNNNN`` atomically, then delete all but the newest ``keep`` checkpoints."""
    from safetensors.torch import save_file

    opt_tensors, param_groups = _flatten_optimizer(optim_state)
    rng_json, rng_tensors = rng_state()
    model_tensors = {k: v.detach().cpu().clone().contiguous() for k, v in model_state.items()}
    meta = {**state, "step": step, "param_groups": param_groups, "rng": rng_json}

    def write(tmp: Path):
        save_file(model_tensors, str(tmp / "model.safetensors"))
        save_file({**opt_tensors, **rng_tensors}, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))

    path = root / f"step-{step:06d}"
    atomic_directory_write(path, write, force=True)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return path


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first (temp directories are hidden, never listed)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def load_checkpoint_dir(path: Path) -> tuple[dict, dict, dict, dict[str, torch.Tensor]]:
    """(model state, optimizer state, state.json, RNG tensors) of one checkpoint directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads((path / "state.json").read_text())
        model_state = load_file(str(path / "model.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        raise CheckpointError(f"{path}: unreadable training checkpoint ({e}); delete it to resume from an older one") from None
    rng = {k: v for k, v in opt_tensors.items() if k.startswith("rng.")}
    return model_state, _unflatten_optimizer(opt_tensors, meta["param_groups"]), meta, rng
