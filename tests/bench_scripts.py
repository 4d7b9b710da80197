"""Fixtures of the benchmark scripts' smoke tests (tests/benchmarks/): the tiny model, its artifacts,
and a way to run a script in this process (a test module imports the fixtures it uses).

Every script in benchmarks/ runs here on a tiny random Llama with the byte-level tokenizer (seconds,
not the real model's minutes); a peer the script compares with (vLLM, llama.cpp, Triton, wrk) is
skipped, saying why, where it is not installed, but the script's own code still runs."""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Wide enough for every format's group sizes (64, 128), long enough for 512-token calibration windows.
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


def load_script(name: str):
    """benchmarks/NAME.py as a module (not run: its ``main`` is called by the test)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run_script(monkeypatch):
    """``run_script(name, *argv, prepare=None)``: benchmarks/NAME.py's ``main`` on ``argv``, as from the
    command line (``prepare(module)`` first, where given); torch's thread count is put back after it."""
    threads = torch.get_num_threads()

    def run(name: str, *argv, prepare=None):
        module = load_script(name)
        if prepare is not None:
            prepare(module)
        monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / f"{name}.py"), *map(str, argv)])
        return module.main()

    yield run
    torch.set_num_threads(threads)


@functools.cache  # once per session, whichever test modules import the fixtures
def _tiny_model(base: Path) -> Path:
    from conftest import make_byte_tokenizer, make_hf_model

    path = base / "bench-scripts" / "tiny-llama"
    tokenizer = make_byte_tokenizer()
    make_hf_model("llama", vocab_size=len(tokenizer), **TINY).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@functools.cache
def compiled(tiny_model: Path, name: str, pipeline: str) -> Path:
    """``tiny_model`` compiled with the passes ``pipeline`` (JSON) lists into a sibling folder ``name``."""
    import json

    import passes  # noqa: F401  (registers the passes)
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = PipelineConfig.from_dict({"calibration": {"samples": 2, "seq_len": 64}, "passes": json.loads(pipeline)})
    return compile_model(tiny_model, config, tiny_model.parent / name, force=True).path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with the byte-level tokenizer beside it."""
    return _tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_artifact(tiny_model) -> Path:
    """The tiny model compiled as float32."""
    return compiled(tiny_model, "float", "[]")


@pytest.fixture(scope="session")
def tiny_int4_artifact(tiny_model) -> Path:
    """The tiny model through a short AWQ INT4 search (group 64)."""
    return compiled(tiny_model, "int4", '[{"name": "awq", "group_size": 64, "alpha_grid": 2, "clip_search": false, '
                                        '"module_candidates": 0, "weight_rounding": "nearest"}]')
