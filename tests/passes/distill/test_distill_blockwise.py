"""Block-wise reconstruction: each block of an INT4 QAT student learns its teacher block's output."""
import pytest
import torch
from distill_helpers import int4_copy, random_sequences, tiny_model

from passes.distill.blockwise import reconstruct_blocks
from passes.distill.errors import DistillConfigError
from passes.distill.loss import kl_per_token
from passes.distill.students import keep_layers_student, make_qat_student


@torch.no_grad()
def mean_kl(teacher, student, ids) -> float:
    return kl_per_token(teacher(ids), student(ids)).mean().item()


def test_every_block_gets_closer_and_so_does_the_output():
    teacher = tiny_model()
    student = int4_copy(teacher, group_size=16)
    make_qat_student(student)
    seqs, held_out = random_sequences(16, 32), random_sequences(8, 32, seed=9)
    before = mean_kl(teacher, student, held_out)
    result = reconstruct_blocks(teacher, student, seqs, epochs=8, lr=3e-3, batch_size=4, max_grad_norm=1.0, seed=0)
    after = mean_kl(teacher, student, held_out)
    print(f"block MSE {result['block_mse_before']} -> {result['block_mse_after']}; held-out KL {before:.4f} -> {after:.4f}")
    assert len(result["block_mse_after"]) == 2 and result["block_skipped_steps"] == 0
    assert all(a < 0.8 * b for a, b in zip(result["block_mse_after"], result["block_mse_before"]))
    assert after < 0.9 * before


def test_reconstruction_is_deterministic():
    def run():
        teacher = tiny_model()
        student = int4_copy(teacher, group_size=16)
        make_qat_student(student)
        reconstruct_blocks(teacher, student, random_sequences(8, 16), epochs=1, lr=1e-3, batch_size=4,
                           max_grad_norm=1.0, seed=3)
        return student.state_dict()
    a, b = run(), run()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_shallower_student_is_a_clear_error():
    teacher = tiny_model()
    with pytest.raises(DistillConfigError, match="block_epochs needs a student as deep and wide as the teacher"):
        reconstruct_blocks(teacher, keep_layers_student(teacher, [0]), random_sequences(), 1, 1e-3, 4, 1.0, 0)


def test_distill_pass_reconstructs_blocks_before_training(tiny_checkpoint_with_tokenizer, tmp_path):
    import passes  # noqa: F401
    from compiler.io.artifact import load_artifact
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    config = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 64}, "passes": [
        {"name": "awq", "group_size": 32},
        {"name": "distill", "teacher": str(path), "steps": 2, "seq_len": 32, "eval_windows": 4, "eval_len": 64,
         "block_epochs": 2, "block_sequences": 8, "block_lr": 1e-3}]})
    metrics = load_artifact(compile_model(path, config, tmp_path / "art").path).manifest.reports[1]["metrics"]
    print({k: v for k, v in metrics.items() if k.startswith("block") or k.startswith("kl")})
    assert len(metrics["block_mse_before"]) == len(metrics["block_mse_after"]) == 2
    assert sum(metrics["block_mse_after"]) < sum(metrics["block_mse_before"])
    assert 0 < metrics["kl_after_blocks"] < metrics["kl_before"]


def test_pipeline_refuses_blocks_with_dropped_layers():
    from compiler.errors import ConfigError
    from compiler.pipeline import Pipeline, PipelineConfig

    entry = {"name": "distill", "student": "keep_layers:0", "block_epochs": 1}
    with pytest.raises(ConfigError, match="block_epochs needs a student as deep as the teacher"):
        Pipeline(PipelineConfig.from_dict({"passes": [entry]})).validate(tiny_model().config)


def test_steps_zero_runs_the_block_phase_alone(tiny_checkpoint_with_tokenizer, tmp_path):
    import passes  # noqa: F401
    from compiler.io.artifact import load_artifact
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    config = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 64}, "passes": [
        {"name": "awq", "group_size": 32},
        {"name": "distill", "teacher": str(path), "steps": 0, "seq_len": 32, "eval_windows": 1, "eval_len": 64,
         "block_epochs": 2, "block_sequences": 8}]})
    from compiler.kernels.int4_cpu import reference_only

    with reference_only():  # Int4Linear in float32, as the fake-quantized student (not the CPU kernel's bf16)
        metrics = load_artifact(compile_model(path, config, tmp_path / "art").path).manifest.reports[1]["metrics"]
    assert metrics["steps"] == 0 and metrics["tokens_trained"] == 0
    # re-packed INT4 computes what the fake-quantized student did
    assert metrics["kl_after"] == pytest.approx(metrics["kl_after_blocks"], rel=1e-3)
