"""Helpers shared by the ONNX / Ascend tests: tiny float and INT4 artifacts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import make_hf_model

from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import linear_modules
from compiler.io.artifact import load_artifact, save_artifact
from compiler.io.load import load_checkpoint
from compiler.io.types import SourceInfo


def make_artifact(tmp_path: Path, arch: str = "llama", int4_group: int | None = None, tokenizer=None,
                  int4_head: bool = False, **overrides) -> Path:
    """Save a tiny random model as an artifact; INT4 (RTN, every linear but lm_head unless ``int4_head``)
    when ``int4_group``."""
    hf_dir = tmp_path / f"hf-{arch}"
    make_hf_model(arch, **overrides).save_pretrained(hf_dir)
    loaded = load_checkpoint(hf_dir, with_tokenizer=False)
    for name, linear in linear_modules(loaded.model).items():
        if int4_group and (name != "lm_head" or int4_head):
            loaded.model.set_submodule(name, Int4Linear.from_float(linear, int4_group))
    out = tmp_path / f"artifact-{arch}-{int4_group or 'float'}"
    source = SourceInfo(str(hf_dir), "hf", "0" * 64)
    return save_artifact(out, loaded.model, tokenizer, source, {}, [])


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|; NaN anywhere gives inf so it never passes."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if np.isnan(got).any() or np.isnan(ref).any():
        return float("inf")
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def torch_logits(artifact: Path, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return load_artifact(artifact).model(ids).numpy()


def make_arch_artifact(tmp_path: Path, case: str, int4_group: int | None = None, fp8: bool = False) -> Path:
    """Save ``arch_helpers.ARCH_CASES[case]`` (Qwen3, Gemma 3, the MoE models ...) as an artifact: float,
    INT4 RTN (``int4_group``) or FP8 weight-only on every linear but lm_head and the routers (which
    every pass keeps in float)."""
    from arch_helpers import make_arch_model

    from compiler.formats.fp8 import Fp8Format, Fp8Linear
    from compiler.model.moe import router_names

    hf_dir = tmp_path / f"hf-{case}"
    make_arch_model(case).save_pretrained(hf_dir)
    loaded = load_checkpoint(hf_dir, with_tokenizer=False)
    keep_float = {"lm_head", *router_names(loaded.model.config)}
    for name, linear in linear_modules(loaded.model).items():
        if name in keep_float:
            continue
        if int4_group:
            loaded.model.set_submodule(name, Int4Linear.from_float(linear, int4_group))
        elif fp8:
            fmt = Fp8Format.for_linear(linear, activation_scheme="none")
            loaded.model.set_submodule(name, Fp8Linear.from_linear(linear, fmt))
    kind = f"int4g{int4_group}" if int4_group else "fp8" if fp8 else "float"
    return save_artifact(tmp_path / f"artifact-{case}-{kind}", loaded.model, None,
                         SourceInfo(str(hf_dir), "hf", "0" * 64), {}, [])


def ragged_rows_error(loaded, bundle: Path, lengths: list[int], steps: int, seed: int = 0) -> float:
    """Worst relative error against the torch model of a bundle decoding rows of different lengths
    together: each prompt prefilled into its own row of one cache (``OnnxRunner.prefill_row``), then
    ``steps`` decode calls over every row at once (``decode_rows``), and half-way the first row
    leaves and the last row's cache moves into its place (``KVCache.move_row``), as the serving
    batcher does. The reference is each sequence run alone through the contiguous cache."""
    from backends.onnx.runner import OnnxRunner
    from compiler.model.kv_cache import ContiguousKVCache

    c = loaded.model.config
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, c.vocab_size, (1, n + steps), generator=gen) for n in lengths]
    runner = OnnxRunner(bundle, threads=1)
    cache = runner.new_cache(len(lengths))
    caches = [ContiguousKVCache(c.n_layers, 1, runner.info.max_len, c.n_kv_heads, c.head_dim,
                                sliding_window=c.sliding_windows) for _ in seqs]
    worst = 0.0
    with torch.no_grad():
        for row, (ids, n, ref_cache) in enumerate(zip(seqs, lengths, caches)):
            got = runner.prefill_row(cache, row, ids[:, :n].numpy())
            worst = max(worst, rel_error(got, loaded.model(ids[:, :n], torch.arange(n)[None], ref_cache).numpy()))
        rows = list(range(len(seqs)))  # rows[r]: the sequence in cache row r
        for t in range(steps):
            if t == steps // 2 and len(rows) > 1:  # the first row leaves; the last one takes its place
                cache.move_row(len(rows) - 1, 0, lengths[rows[-1]] + t)
                rows = [rows[-1]] + rows[1:-1]
            ids = np.array([[int(seqs[s][0, lengths[s] + t])] for s in rows], np.int64)
            past = np.array([lengths[s] + t for s in rows], np.int64)
            got = runner.decode_rows(cache, ids, past)
            for r, s in enumerate(rows):
                pos = lengths[s] + t
                ref = loaded.model(seqs[s][:, pos:pos + 1], torch.tensor([[pos]]), caches[s]).numpy()
                worst = max(worst, rel_error(got[r:r + 1], ref))
    return worst
