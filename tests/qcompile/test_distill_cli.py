"""``qcompile distill`` end to end on tiny checkpoints: QAT from an INT4 artifact, DDP equivalence, errors, the pass."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distill_helpers import int4_copy, max_difference

from compiler.formats.int4 import Int4Linear
from compiler.io.artifact import load_artifact, save_artifact
from compiler.io.load import load_checkpoint
from passes.distill.data import corpus_tokens

REPO = Path(__file__).resolve().parents[2]
FAST = ["--seq-len", "32", "--batch-size", "4", "--eval-windows", "2", "--eval-len", "64"]


def qcompile(*args, launcher=()):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "QCOMPILE_PROGRESS": "0"}
    cmd = [*launcher, "-c", "from qcompile.cli import main; main()", *map(str, args)] if not launcher else \
        [*launcher, str(REPO / "tests" / "qcompile_entry.py"), *map(str, args)]
    return subprocess.run([sys.executable, *cmd] if not launcher else cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def teacher_dir(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer("llama")
    return path


def test_qat_from_an_int4_artifact_recovers_and_stays_int4(teacher_dir, tmp_path):
    loaded = load_checkpoint(teacher_dir)
    int4 = tmp_path / "int4"
    save_artifact(int4, int4_copy(loaded.model), loaded.tokenizer, loaded.source, {"passes": [{"name": "rtn-test"}]},
                  [{"name": "rtn-test", "metrics": {}, "notes": []}])
    extra = tmp_path / "extra.txt"
    extra.write_text("More training text. " * 100)
    r = qcompile("distill", "--teacher", teacher_dir, "--student", int4, "--steps", 12, "--lr", "1e-3", *FAST,
                 "--block-epochs", 1, "--block-sequences", 8, "--generated-sequences", 4, "--train-corpus", extra,
                 "-o", tmp_path / "out", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    pools = [corpus_tokens(loaded.tokenizer, c).pool for c in ("pydoc", str(extra))]
    assert result["training_sequences"] == sum(len(p) // 32 for p in pools) + 4  # both pools, the teacher's text
    assert result["qat_layers"] == 14
    assert len(result["block_mse_after"]) == 2  # block-wise reconstruction ran first
    assert result["kl_after"] < result["kl_before"]
    seen = result["trained_sample"]  # the training text's own KL is reported beside the held-out KL
    assert seen["before"]["tokens"] == 16 * 32 and seen["after"]["kl"] < seen["before"]["kl"]
    student = load_artifact(tmp_path / "out" / "student")
    assert sum(isinstance(m, Int4Linear) for m in student.model.modules()) == 14
    assert student.manifest.modules["layers.0.mlp.up_proj"]["format"] == "int4"
    # the student artifact's passes come first, in the recipe and in the reports
    assert [p["name"] for p in student.manifest.reports] == ["rtn-test", "distill"]
    assert [p["name"] for p in student.manifest.pipeline["passes"]] == ["rtn-test", "distill"]
    assert student.manifest.reports[1]["metrics"]["kl_after"] == result["kl_after"]
    assert json.loads((tmp_path / "out" / "result.json").read_text()) == result
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12 and {"loss", "kl", "mse", "ce", "lr", "grad_norm", "tokens_per_s"} <= set(json.loads(lines[0]))
    r = qcompile("distill", "--teacher", teacher_dir, "--student", int4, "--steps", 12, *FAST, "-o", tmp_path / "out", "--force")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "already holds training checkpoints" in r.stderr


def test_scales_only_end_to_end_keeps_the_int4_codes(teacher_dir, tmp_path):
    """--e2e-params scales (E2E-QP): the student's codes and zero points stay those it came with."""
    loaded = load_checkpoint(teacher_dir)
    int4 = tmp_path / "int4"
    save_artifact(int4, int4_copy(loaded.model), loaded.tokenizer, loaded.source, {"passes": [{"name": "rtn-test"}]}, [])
    r = qcompile("distill", "--teacher", teacher_dir, "--student", int4, "--steps", 8, "--lr", "1e-4", *FAST,
                 "--e2e-params", "scales", "-o", tmp_path / "out", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["kl_after"] < result["kl_before"]
    before, after = load_artifact(int4).model.layers[0].mlp.up_proj, load_artifact(tmp_path / "out" / "student").model.layers[0].mlp.up_proj
    assert torch.equal(after.qweight, before.qweight) and torch.equal(after.qzeros, before.qzeros)
    assert not torch.equal(after.scales, before.scales)
    r = qcompile("distill", "--teacher", teacher_dir, "--student", "keep_layers:0", "--e2e-params", "scales", *FAST,
                 "-o", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no INT4 layers" in r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("shard", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_process_gloo_ddp_equals_one_process(teacher_dir, tmp_path, shard):
    args = ["distill", "--teacher", teacher_dir, "--student", "keep_layers:1", "--steps", 3, "--grad-accum", 2, *FAST]
    single = qcompile(*args, "-o", tmp_path / "single")
    assert single.returncode == 0, single.stderr
    assert "train" in single.stdout  # the row for a sample of the training text, beside the held-out rows
    ddp = qcompile(*args, *shard, "-o", tmp_path / "ddp",
                   launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"))
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    a = load_artifact(tmp_path / "single" / "student").model.state_dict()
    b = load_artifact(tmp_path / "ddp" / "student").model.state_dict()
    diff = max_difference(a, b)
    assert diff <= 1e-5, f"DDP differs from one process by {diff}"
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], load_checkpoint(teacher_dir).model.state_dict()["layers.1.mlp.up_proj.weight"])


def test_cli_errors_are_one_line(teacher_dir, tmp_path):
    r = qcompile("distill", "--teacher", teacher_dir, "--student", "keep_layers:7", "-o", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "layer indices" in r.stderr
    r = qcompile("distill", "--teacher", teacher_dir, "--student", "keep_layers:0", "--steps", 0, "-o", tmp_path / "x")
    assert r.returncode == 2 and "steps must be >= 1" in r.stderr and "Traceback" not in r.stderr
    r = qcompile("distill", "--teacher", teacher_dir, "--student", "keep_layers:0", "--corpus", tmp_path / "none.txt", "-o", tmp_path / "x")
    assert r.returncode == 2 and "not found" in r.stderr
    r = qcompile("distill", "--teacher", teacher_dir, "--student", "keep_layers:0", "--batch-size", 3, "--steps", 1,
                 "-o", tmp_path / "y", launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"))
    assert r.returncode != 0 and "not a multiple of the 2 ranks" in r.stderr


def test_flags_are_the_options_fields_and_build_a_one_pass_pipeline(teacher_dir, tmp_path, monkeypatch, capsys):
    """Every DistillOptions field is a flag (lists: comma lists or repeated); the command compiles a
    pipeline of one distill pass, the keep_layers student being the teacher with layers dropped."""
    import compiler.pipeline.compile as compile_module
    from qcompile.cli import main

    calls = []
    monkeypatch.setattr(compile_module, "compile_loaded", lambda loaded, pipeline, out, force: calls.append(pipeline) or 1 / 0)
    monkeypatch.setattr(sys, "argv", ["qcompile", "distill", "--teacher", str(teacher_dir), "--student", "keep_layers:0",
                                      "--weight-decay", "0.01", "--heldout", "a.txt,b.txt", "--heldout", "c.txt",
                                      "--train-corpus", "d.txt", "--learn-qparams", "-o", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main()
    (entry,) = calls[0].config.passes  # the Pipeline the command built once, before the loads
    assert entry["name"] == "distill" and entry["student"] == "keep_layers:0" and entry["teacher"] == ""
    assert entry["weight_decay"] == 0.01 and entry["heldout"] == ["a.txt", "b.txt", "c.txt"]
    assert entry["train_corpora"] == ["d.txt"] and entry["learn_qparams"] and entry["output_dir"] == str(tmp_path / "o")
    assert entry["steps"] == 100 and "layer_map" not in entry  # dataclass defaults; layer_map: pipeline files only


def test_resume_reaches_the_pass(teacher_dir, tmp_path):
    """--resume continues from OUT/checkpoints (here: the finished run's last step, so no step reruns)."""
    args = ["distill", "--teacher", teacher_dir, "--student", "keep_layers:1", "--steps", 2, *FAST, "-o", tmp_path / "o", "--json"]
    first = qcompile(*args)
    assert first.returncode == 0, first.stderr
    again = qcompile(*args, "--resume")
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert result["resumed_from"] == 2 and result["kl_after"] == json.loads(first.stdout)["kl_after"]


def test_the_target_check_runs_before_training(teacher_dir, tmp_path):
    """--target checks the formats an artifact student already holds, as a pipeline's [target] does."""
    loaded = load_checkpoint(teacher_dir)
    int4 = tmp_path / "int4"
    save_artifact(int4, int4_copy(loaded.model, group_size=64), loaded.tokenizer, loaded.source, {}, [])
    r = qcompile("distill", "--teacher", teacher_dir, "--student", int4, "--target", "vllm", *FAST, "-o", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "target 'vllm' cannot run" in r.stderr and "down_proj" in r.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_distill_pass_in_a_pipeline(teacher_dir, tmp_path):
    import passes  # noqa: F401
    from compiler.errors import PipelineValidationError
    from compiler.pipeline import Pipeline, PipelineConfig
    from compiler.pipeline.compile import compile_model

    entry = {"name": "distill", "student": "keep_layers:0", "steps": 2, "seq_len": 32, "eval_windows": 1, "eval_len": 64}
    result = compile_model(teacher_dir, PipelineConfig.from_dict({"passes": [entry]}), tmp_path / "art")
    art = load_artifact(result.path)
    assert art.model.config.n_layers == 1
    metrics = art.manifest.reports[0]["metrics"]
    assert {"kl_before", "kl_after", "top1_agreement_before", "top1_agreement_after"} <= set(metrics)
    bad = PipelineConfig.from_dict({"passes": [{**entry, "student": "keep_layers:0,9"}]})
    with pytest.raises(PipelineValidationError, match="distill"):
        Pipeline(bad).validate(art.model.config.__class__(**{**art.model.config.to_dict(), "n_layers": 2}))
