"""Every refusal of the artifact loader, each one line naming the artifact: an edited manifest, a
manifest without its checksum, missing and extra tensors, shape and dtype mismatches, a truncated
or missing weights file, a missing or edited tokenizer file (a file dropped beside them is never
read), an unknown weight format, a module the config lacks, tensors that do not fit the config, a
bad KV-cache entry."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from artifact_helpers import read_raw_manifest, read_weights, rewrite_manifest, rewrite_weights

from compiler.errors import ArtifactError
from compiler.io.artifact import MANIFEST_SHA_KEY, WEIGHTS, load_artifact, manifest_sha256, read_manifest
from compiler.io.summary import artifact_summary
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def artifact(tiny_checkpoint_with_tokenizer, tmp_path):
    src, _ = tiny_checkpoint_with_tokenizer("llama")
    return compile_model(src, PipelineConfig(), tmp_path / "art").path


def refused(artifact: Path, match: str, load=load_artifact) -> str:
    """The loader's error: an ArtifactError of one line that names the artifact and matches ``match``."""
    with pytest.raises(ArtifactError, match=match) as e:
        load(artifact)
    message = str(e.value)
    assert "\n" not in message and str(artifact) in message, message
    return message


def test_edited_manifest_is_refused(artifact):
    """rope_theta × 10 changes every output; it used to load without a word."""
    manifest = read_raw_manifest(artifact)
    manifest["model_config"]["rope_theta"] *= 10
    (artifact / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for load in (load_artifact, read_manifest, artifact_summary):  # loading, lowering, inspect
        refused(artifact, "does not match the checksum its weights file holds", load)


@pytest.mark.parametrize("edit", [
    lambda m: m["tensors"]["norm.weight"].update(sha256="0" * 64),  # hides a corrupted tensor
    lambda m: m.update(tokenizer=False),
    lambda m: m.update(kv_cache={"dtype": "float8_e4m3fn"}),  # a declared entry planted by hand
    lambda m: m["pipeline"].update(passes=[{"name": "awq"}]),
], ids=["tensor-checksum", "tokenizer-flag", "planted-entry", "pipeline"])
def test_any_content_edit_is_refused(artifact, edit):
    manifest = read_raw_manifest(artifact)
    edit(manifest)
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    refused(artifact, "edited or corrupt")


def test_reformatting_the_manifest_is_not_an_edit(artifact):
    """The checksum is of the content (canonical JSON), not of the bytes."""
    manifest = read_raw_manifest(artifact)
    (artifact / "manifest.json").write_text(json.dumps(manifest, indent=4, sort_keys=True))
    assert load_artifact(artifact).manifest.to_json() == manifest


def test_checksum_is_of_the_content():
    a = {"b": [1, 2.5, {"c": None}], "a": "é"}
    assert manifest_sha256(a) == manifest_sha256(json.loads(json.dumps(a, indent=3)))
    assert manifest_sha256(a) != manifest_sha256({**a, "b": [1, 2.5000001, {"c": None}]})


def test_weights_without_a_manifest_checksum_need_a_recompile(artifact):
    """An artifact written before the checksum existed (or not by qcompile)."""
    rewrite_weights(artifact, read_weights(artifact), metadata={"format": "pt"})
    refused(artifact, "holds no manifest checksum.*recompile")


def test_missing_tensors(artifact):
    tensors = read_weights(artifact)
    del tensors["layers.1.mlp.down_proj.weight"]
    rewrite_weights(artifact, tensors)
    assert "missing ['layers.1.mlp.down_proj.weight']" in refused(artifact, "weights do not match the manifest")


def test_extra_tensors(artifact):
    tensors = read_weights(artifact)
    tensors["layers.0.smuggled"] = torch.zeros(3)
    rewrite_weights(artifact, tensors)
    message = refused(artifact, "weights do not match the manifest")
    assert "not in the manifest ['layers.0.smuggled']" in message and "missing" not in message


def test_shape_mismatch_with_the_same_bytes(artifact):
    """Same bytes, so the same checksum: only the shape check sees it."""
    tensors = read_weights(artifact)
    w = tensors["layers.0.mlp.gate_proj.weight"]  # [96, 64]
    tensors["layers.0.mlp.gate_proj.weight"] = w.reshape(64, 96).clone()
    rewrite_weights(artifact, tensors)
    refused(artifact, r"tensor layers.0.mlp.gate_proj.weight is float32 \[64, 96\], the manifest says float32 \[96, 64\]")


def test_dtype_mismatch(artifact):
    tensors = read_weights(artifact)
    tensors["norm.weight"] = tensors["norm.weight"].view(torch.int32).clone()
    rewrite_weights(artifact, tensors)
    refused(artifact, "tensor norm.weight is int32 .*the manifest says float32")


def test_changed_tensor_values(artifact):
    tensors = read_weights(artifact)
    tensors["norm.weight"][3] += 1e-3
    rewrite_weights(artifact, tensors)
    refused(artifact, "tensor norm.weight fails its checksum")


def test_tensors_that_do_not_fit_the_model_config(artifact):
    """A consistent manifest (re-sealed) whose config is not the one its tensors were made for."""
    manifest = read_raw_manifest(artifact)
    manifest["model_config"]["intermediate_size"] += 32
    rewrite_manifest(artifact, manifest)
    refused(artifact, "tensors do not fit its model config")


@pytest.mark.parametrize("cut", [100, 10**9])
def test_truncated_weights(artifact, cut):
    """Cut inside the tensors (the header still reads) or down to a few bytes (it does not)."""
    f = artifact / WEIGHTS
    data = f.read_bytes()
    f.write_bytes(data[:-cut] if cut < len(data) else data[:5])
    refused(artifact, "corrupt or truncated")


def test_missing_weights_file(artifact):
    (artifact / WEIGHTS).unlink()
    refused(artifact, f"no {WEIGHTS}; the artifact is incomplete")


def test_the_manifest_hashes_every_tokenizer_file_written(artifact):
    listed = read_manifest(artifact).tokenizer_files
    on_disk = sorted(p.name for p in artifact.iterdir() if p.name.startswith("tokenizer"))
    assert sorted(listed) == on_disk and "tokenizer.json" in listed
    assert all(listed[name] == hashlib.sha256((artifact / name).read_bytes()).hexdigest() for name in listed)


def test_missing_tokenizer(artifact):
    """The manifest promises a tokenizer; without its files the artifact used to load with none."""
    assert read_manifest(artifact).has_tokenizer is True and load_artifact(artifact).tokenizer is not None
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        (artifact / name).unlink(missing_ok=True)
    refused(artifact, "tokenizer file tokenizer.json is missing")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_one_missing_tokenizer_file(artifact, name):
    (artifact / name).unlink()
    for load in (load_artifact, read_manifest):  # loading, and lowering (which copies the directory)
        refused(artifact, f"tokenizer file {name} is missing", load)


def test_edited_tokenizer_file(artifact):
    """One merge rule dropped: a tokenizer that still loads."""
    path = artifact / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["model"]["merges"] = tokenizer["model"]["merges"][:-1]
    path.write_text(json.dumps(tokenizer))
    for load in (load_artifact, read_manifest, artifact_summary):
        refused(artifact, "tokenizer file tokenizer.json fails its checksum", load)


@pytest.mark.parametrize("name", ["added_tokens.json", "special_tokens_map.json", "notes/readme.txt"])
def test_a_file_dropped_into_the_artifact_is_never_read(artifact, name):
    """The tokenizer is loaded from the files the manifest lists alone: one the loader would read
    from the directory (an added token, another end-of-text token) changes nothing, and a note is harmless."""
    want = load_artifact(artifact).tokenizer
    (artifact / name).parent.mkdir(exist_ok=True)
    (artifact / name).write_text('{"<extra>": 320}' if name == "added_tokens.json" else
                                 '{"eos_token": "<extra>"}' if name.endswith(".json") else "notes")
    got = load_artifact(artifact).tokenizer
    assert len(got) == len(want) and got.eos_token == want.eos_token
    assert got("import os <extra>")["input_ids"] == want("import os <extra>")["input_ids"]


def test_an_artifact_from_before_tokenizer_hashes_loads_as_before(artifact):
    """No ``tokenizer_files``: its tokenizer is loaded unchecked, but must be there when promised."""
    manifest = read_raw_manifest(artifact)
    del manifest["tokenizer_files"]
    rewrite_manifest(artifact, manifest)  # an older qcompile's sealed manifest
    (artifact / "added_tokens.json").write_text("{}")
    assert load_artifact(artifact).tokenizer is not None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (artifact / name).unlink()
    refused(artifact, "the manifest lists a tokenizer but the artifact holds no tokenizer files")


def test_unknown_weight_format(artifact):
    manifest = read_raw_manifest(artifact)
    manifest["modules"]["layers.0.mlp.up_proj"] = {"format": "int3", "group_size": 64}
    rewrite_manifest(artifact, manifest)
    refused(artifact, "weight format 'int3', which this qcompile does not know")


def test_converted_module_the_config_lacks(artifact):
    manifest = read_raw_manifest(artifact)
    manifest["modules"]["layers.7.mlp.up_proj"] = {"format": "int4", "group_size": 64, "zero_point": True}
    rewrite_manifest(artifact, manifest)
    refused(artifact, "converts module 'layers.7.mlp.up_proj', which its model config does not have")


def test_bad_kv_cache_entry(artifact):
    manifest = read_raw_manifest(artifact)
    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_tensor", "k_scale": [0.1], "v_scale": [0.1, 0.1]}
    rewrite_manifest(artifact, manifest)
    refused(artifact, "k_scale must hold 2 layers")


def test_unknown_schema_version(artifact):
    manifest = read_raw_manifest(artifact)
    manifest["schema_version"] = 2
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    refused(artifact, "schema version 2, this qcompile reads 1; recompile it")


def test_the_weights_file_vouches_for_the_manifest(artifact):
    from safetensors import safe_open

    with safe_open(str(artifact / WEIGHTS), framework="pt") as f:
        assert f.metadata()[MANIFEST_SHA_KEY] == manifest_sha256(read_raw_manifest(artifact))


def test_cli_prints_the_refusal_as_one_line(artifact):
    manifest = read_raw_manifest(artifact)
    manifest["model_config"]["rope_theta"] *= 10
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    for command in (["inspect", str(artifact)], ["generate", str(artifact), "def f", "--max-tokens", "2"]):
        proc = subprocess.run([sys.executable, "-m", "qcompile", *command], capture_output=True, text=True,
                              cwd=ROOT, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                          "QCOMPILE_PROGRESS": "0"})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "does not match the checksum" in lines[0] and str(artifact) in lines[0]
