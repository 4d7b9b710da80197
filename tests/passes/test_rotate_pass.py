"""The rotate pass (``passes/rotate.py``): its matrices are orthogonal, the rotated float model computes
the same logits on each architecture it takes, an outlier channel no longer dominates the per-token
INT8 range, the rotated INT8 artifact reloads and exports its untied head, and its refusals."""
from __future__ import annotations

import json

import pytest
import torch
from arch_helpers import make_arch_model
from conftest import make_hf_model
from numerics import relative_error
from safetensors import safe_open

import backends  # noqa: F401  (registers the vllm target)
import passes  # noqa: F401  (registers the passes)
from compiler.deploy.lowering import lower
from compiler.errors import PipelineValidationError
from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_loaded
from compiler.quant.int8 import quantize_per_token
from passes.rotate import hadamard, rotate_residual, rotation_matrix

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}


def ids(vocab=128):
    return torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(3))


def loaded(tmp_path, hf_model):
    """Our model of ``hf_model``, its norm weights moved away from ones (so folding them is exercised)."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.mul_(1 + torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    hf_model.save_pretrained(tmp_path / "hf")
    return load_checkpoint(tmp_path / "hf")


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("dim", [64, 576, 96, 7])
def test_rotations_are_orthogonal_and_seeded(kind, dim):
    q = rotation_matrix(dim, kind, seed=1)
    assert q.dtype == torch.float64 and q.shape == (dim, dim)
    assert (q @ q.T - torch.eye(dim, dtype=torch.float64)).abs().max() < 1e-12
    assert torch.equal(q, rotation_matrix(dim, kind, seed=1))
    assert not torch.equal(q, rotation_matrix(dim, kind, seed=2))


def test_hadamard_of_a_power_of_two_spreads_every_channel_evenly():
    q = rotation_matrix(64, "hadamard", seed=0)
    assert torch.allclose(q.abs(), torch.full_like(q, 64 ** -0.5))
    assert torch.equal(hadamard(4) * 2, torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]],
                                                     dtype=torch.float64))


@pytest.mark.parametrize("make", [
    lambda: make_hf_model("llama"),
    lambda: make_hf_model("llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    lambda: make_hf_model("qwen2"),  # q/k/v biases
    lambda: make_arch_model("qwen3-wide-heads-tied"),  # q/k norms, tied
], ids=["llama", "llama-tied-biases", "qwen2", "qwen3-tied"])
@torch.no_grad()
def test_rotated_model_computes_the_same_logits(tmp_path, make):
    model = loaded(tmp_path, make()).model
    before = model(ids())
    rotate_residual(model, rotation_matrix(model.config.dim, "hadamard", 0))
    after = model(ids())
    err = relative_error(after, before)
    print(f"rotated logits {err:.2e} from the model's own")
    assert err < 1e-5
    norms = [m.weight for n, m in model.named_modules() if n.endswith("layernorm") or n == "norm"]
    assert all(torch.equal(w, torch.ones_like(w)) for w in norms)
    assert not model.config.tie_embeddings and model.lm_head.weight is not model.embed_tokens.weight


@torch.no_grad()
def test_rotation_takes_an_outlier_channel_out_of_the_per_token_range(tmp_path):
    model = loaded(tmp_path, make_hf_model("llama")).model
    model.layers[0].input_layernorm.weight[5] = 60.0  # one channel of q/k/v's input far above the rest
    seen = []
    hook = model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))

    def q_proj_input_error():
        seen.clear()
        model(ids())
        x = seen[0].reshape(-1, seen[0].shape[-1]) @ model.layers[0].self_attn.q_proj.weight.T
        codes, scale, _ = quantize_per_token(seen[0].reshape(-1, seen[0].shape[-1]), True)
        return relative_error((codes.float() * scale) @ model.layers[0].self_attn.q_proj.weight.T, x)

    plain = q_proj_input_error()
    rotate_residual(model, rotation_matrix(model.config.dim, "hadamard", 0))
    rotated = q_proj_input_error()
    hook.remove()
    print(f"q_proj output error of INT8 per-token inputs: {plain:.4f} plain, {rotated:.4f} rotated")
    assert rotated < plain / 2  # measured: 0.0158 plain, 0.0053 rotated


@torch.no_grad()
def test_rotated_int8_artifact_reloads_and_exports_its_own_head(tiny_checkpoint_with_tokenizer, tmp_path):
    path, _ = tiny_checkpoint_with_tokenizer("llama", tie_word_embeddings=True)
    source = load_checkpoint(path)
    pipeline = PipelineConfig.from_dict({"calibration": CALIB, "passes": [
        {"name": "rotate"}, {"name": "int8", "smoothing_strength": 0.5}]})
    result = compile_loaded(source, pipeline, tmp_path / "a")
    reloaded = load_artifact(result.path).model
    assert torch.equal(reloaded(ids(300)), source.model(ids(300)))
    assert not reloaded.config.tie_embeddings
    assert result.reports[0].metrics == {"rotation": "hadamard", "seed": 0, "dim": 64}
    out = lower(result.path, "vllm", tmp_path / "vllm").path
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", "pt") as f:
        head = f.get_tensor("lm_head.weight")
    assert torch.equal(head, reloaded.lm_head.weight.to(head.dtype))


def test_rotate_after_a_converting_pass_is_refused(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer("llama")
    pipeline = PipelineConfig.from_dict({"calibration": CALIB, "passes": [
        {"name": "int8"}, {"name": "paged_kv"}, {"name": "rotate"}]})
    with pytest.raises(PipelineValidationError, match=r"passes\[2\] \(rotate\): must run before any pass that "
                                                       r"converts layers \(passes\[0\] \(int8\)\)"):
        compile_loaded(load_checkpoint(path), pipeline, path.parent / "never")
    assert not (path.parent / "never").exists()


@pytest.mark.parametrize("case, why", [("gemma3", "sandwich norms"), ("qwen3-moe", "has mixture-of-experts or latent-attention layers")])
def test_architectures_it_cannot_rotate_are_refused(tmp_path, case, why):
    make_arch_model(case).save_pretrained(tmp_path / "hf")
    pipeline = PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": "rotate"}]})
    with pytest.raises(PipelineValidationError, match=f"rotate: .*{why}.*; leave the rotate pass out for it"):
        compile_loaded(load_checkpoint(tmp_path / "hf"), pipeline, tmp_path / "never")
