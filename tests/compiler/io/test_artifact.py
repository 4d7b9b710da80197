"""Artifacts: round trip (float and INT4), manifest contents, atomic writes, corruption detection."""
import json

import pytest
import torch

from compiler.errors import ArtifactError
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import linear_modules
from compiler.io.artifact import load_artifact, read_manifest
from compiler.io.load import load_checkpoint
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model


def ids(vocab, T=16, seed=0):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def test_float_artifact_round_trip(tiny_checkpoint_with_tokenizer, tmp_path):
    src, hf = tiny_checkpoint_with_tokenizer("qwen2", tie_word_embeddings=True)
    result = compile_model(src, PipelineConfig(), tmp_path / "art")
    loaded = load_artifact(result.path)
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), result.loaded.model(x))
    assert loaded.tokenizer("def f(x)")["input_ids"] == result.loaded.tokenizer("def f(x)")["input_ids"]
    m = read_manifest(result.path)
    assert m.to_json()["schema_version"] == 1 and m.source.kind == "hf" and len(m.source.sha256) == 64
    assert m.pipeline["passes"] == [] and m.aliases == {"lm_head.weight": "embed_tokens.weight"}
    assert all(len(t["sha256"]) == 64 for t in m.tensors.values())
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight


def test_int4_artifact_round_trip(tiny_checkpoint, tmp_path):
    from compiler.io.artifact import save_artifact

    src, _ = tiny_checkpoint("llama", hidden_size=96)  # 96: g64 does not divide -> padded blocks
    loaded = load_checkpoint(src)
    for name, linear in linear_modules(loaded.model).items():
        if name != "lm_head":
            loaded.model.set_submodule(name, Int4Linear.from_float(linear, 64))
    save_artifact(tmp_path / "int4", loaded.model, None, loaded.source, {}, [])
    back = load_artifact(tmp_path / "int4")
    x = ids(128)
    with torch.no_grad():
        assert torch.equal(back.model(x), loaded.model(x))
    q = back.model.layers[0].mlp.down_proj
    assert isinstance(q, Int4Linear) and q.format_meta()["padded_in_features"] == 128
    manifest = read_manifest(tmp_path / "int4")
    assert manifest.modules["layers.0.self_attn.q_proj"]["format"] == "int4"
    assert manifest.tensors["layers.0.self_attn.q_proj.qweight"]["dtype"] == "uint8"


def test_existing_output_needs_force(tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint("llama")
    compile_model(src, PipelineConfig(), tmp_path / "art")
    with pytest.raises(ArtifactError, match="already exists.*--force"):
        compile_model(src, PipelineConfig(), tmp_path / "art")
    compile_model(src, PipelineConfig(), tmp_path / "art", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "tiny-llama"]


def test_interrupted_write_leaves_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    from compiler.io.shards import ShardWriter

    src, _ = tiny_checkpoint("llama")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardWriter, "_write_shard", crash)
    with pytest.raises(KeyboardInterrupt):
        compile_model(src, PipelineConfig(), tmp_path / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]


def test_atomic_writes_give_the_modes_a_plain_write_would(tmp_path):
    """mkdtemp's 0700 directory and a writer's 0600 file (safetensors' save_file) would lock out the
    server of a container that mounts the output: the written tree takes the umask's modes."""
    import os

    from compiler.io.atomic import atomic_directory_write, atomic_write_text

    def write(tmp):
        (tmp / "sub").mkdir(mode=0o700)
        for name, mode in (("weights", 0o600), ("sub/script.sh", 0o700)):
            (tmp / name).write_text("x")
            os.chmod(tmp / name, mode)

    mask = os.umask(0o022)
    try:
        atomic_directory_write(tmp_path / "out", write)
        atomic_write_text(tmp_path / "result.json", "{}")
    finally:
        os.umask(mask)
    modes = {p: oct(os.stat(tmp_path / p).st_mode & 0o777) for p in ("out", "out/sub", "out/weights", "out/sub/script.sh",
                                                                      "result.json")}
    assert modes == {"out": "0o755", "out/sub": "0o755", "out/weights": "0o644", "out/sub/script.sh": "0o744",
                     "result.json": "0o644"}


@pytest.fixture
def artifact(tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint("llama")
    return compile_model(src, PipelineConfig(), tmp_path / "art").path


def test_flipped_byte_fails_checksum(artifact):
    f = artifact / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="fails its checksum"):
        load_artifact(artifact)


def test_truncated_weights(artifact):
    f = artifact / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="corrupt or truncated"):
        load_artifact(artifact)


def test_schema_version_and_missing_manifest(artifact, tmp_path):
    m = json.loads((artifact / "manifest.json").read_text())
    m["schema_version"] = 99
    (artifact / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="schema version 99"):
        load_artifact(artifact)
    with pytest.raises(ArtifactError, match="not a qcompile artifact"):
        load_artifact(tmp_path)
    (artifact / "manifest.json").write_text("{")
    with pytest.raises(ArtifactError, match="corrupt"):
        load_artifact(artifact)


def test_the_manifest_reads_back_as_the_record_it_was_written_from(tiny_checkpoint, tmp_path):
    """``read_manifest`` gives the ``ArtifactRecord`` the writer wrote: typed fields, the entries passes
    declared as ``extras``, and its JSON exactly the file's."""
    from artifact_helpers import read_raw_manifest

    from compiler.io.artifact import ArtifactRecord, manifest_sha256, save_artifact

    src, _ = tiny_checkpoint("llama")
    loaded = load_checkpoint(src)
    loaded.model.set_submodule("layers.0.mlp.up_proj", Int4Linear.from_float(loaded.model.layers[0].mlp.up_proj, 32))
    pipeline, reports, serving = {"passes": [{"name": "rtn"}]}, [{"name": "rtn", "metrics": {"layers": 1}}], {"block_size": 8}
    save_artifact(tmp_path / "a", loaded.model, None, loaded.source, pipeline, reports, {"serving": serving})
    record = read_manifest(tmp_path / "a")
    assert (record.config, record.dtype, record.source) == (loaded.model.config, torch.float32, loaded.source)
    assert (record.pipeline, record.reports, record.extras) == (pipeline, reports, {"serving": serving})
    assert record.serving == serving and record.kv_cache is None and record.dtype_name == "float32"
    assert record.modules == {"layers.0.mlp.up_proj": loaded.model.layers[0].mlp.up_proj.format_meta()}
    assert record.aliases == {} and not record.has_tokenizer and record.tokenizer_files == {}
    raw = read_raw_manifest(tmp_path / "a")
    assert record.to_json() == raw
    assert list(raw) == ["schema_version", "created", "source", "model_config", "dtype", "pipeline", "passes", "modules",
                         "tensors", "aliases", "tokenizer", "tokenizer_files", "serving"]  # the file's layout, extras last
    assert ArtifactRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert record.sha256 == manifest_sha256(raw)  # what the weights file vouches for (the GGUF file records it)


def test_a_sealed_manifest_qcompile_did_not_write_is_one_line(tiny_checkpoint, tmp_path):
    """A manifest whose checksum matches but that lacks what qcompile writes: an ArtifactError, not a KeyError."""
    from artifact_helpers import read_raw_manifest, rewrite_manifest

    src, _ = tiny_checkpoint("llama")
    path = compile_model(src, PipelineConfig(), tmp_path / "art").path
    manifest = read_raw_manifest(path)
    del manifest["model_config"]
    rewrite_manifest(path, manifest)
    with pytest.raises(ArtifactError, match="not a qcompile manifest .KeyError: 'model_config'.; recompile") as e:
        load_artifact(path)
    assert "\n" not in str(e.value)
