"""Smoke tests of distill_smollm2.py (its three modes, on the tiny model as teacher) and streaming_memory.py
(random checkpoints of a tiny width: the script's subprocess per compile, its tables and checks)."""
from __future__ import annotations

import json
import math

pytest_plugins = ["bench_scripts"]  # the fixtures: run_script, tiny_model


def test_distill_qat_and_half(run_script, tiny_model, tmp_path):
    common = ["--model", tiny_model, "--steps", 1, "--seq-len", 16, "--batch-size", 1, "--eval-windows", 1,
              "--eval-len", 32, "--out", tmp_path]
    qat = run_script("distill_smollm2", "qat", *common, "--student", "rtn", "--block-epochs", 1, "--block-sequences", 2)
    (row,) = json.loads((tmp_path / "qat.json").read_text())["rows"]
    assert row["what"] == "qat" and qat["rows"] == [row]
    assert set(row["heldout"]) == {"pydoc", "stdlib-docs"}
    assert all(math.isfinite(v["after"]["kl"]) for v in row["heldout"].values())
    half = run_script("distill_smollm2", "half", *common, "--variants", "kd")
    assert set(half["rows"][0]) >= {"student", "kd"}


def test_distill_memory(run_script, tiny_model, tmp_path):
    doc = run_script("distill_smollm2", "memory", "--model", tiny_model, "--steps", 1, "--seq-len", 16,
                     "--batch-size", 1, "--out", tmp_path)
    (row,) = doc["rows"]
    with_, without = row["with_checkpointing"], row["without_checkpointing"]
    assert with_["gradient_checkpointing"] and not without["gradient_checkpointing"]
    assert with_["tokens_per_s"] > 0 and with_["saved_activation_mib_per_step"] < without["saved_activation_mib_per_step"]


def tiny_width(module) -> None:  # the checkpoints are written here; each compile's process reads them as they are
    module.WIDTH = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def test_streaming_memory(run_script, tmp_path):
    doc = run_script("streaming_memory", "--depths", "2", "--big-layers", 2, "--big-pipelines", "fp8-weights",
                     "--limit", "2GiB", "--work", tmp_path / "work", "--json", tmp_path / "out.json", prepare=tiny_width)
    streamed, in_memory = doc["rows"]
    assert (streamed["streamed"], in_memory["streamed"]) == (True, False)
    assert streamed["same_tensors_as_in_memory"] and streamed["peak_rss_bytes"] > 0
    (limited,) = doc["limited"]
    assert limited["same_tensors_as_in_memory"] and limited["same_logits_as_in_memory"]
    assert json.loads((tmp_path / "out.json").read_text())["schema"] == "qcompile.benchmark"
