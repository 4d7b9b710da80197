"""Per-layer sensitivity and bits spent by it (issue 45), on tiny random checkpoints: every converted
row's ``output_error``, the KL of a layer alone (``sensitivity = "kl"``), ``qcompile inspect``'s most
sensitive layers, ``average_bits`` (INT4 with INT8 for the units it helps most per bit), the mixed
artifact's round trip, the refusals, and ``scale_refit``."""
from __future__ import annotations

import copy
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import passes  # noqa: F401  (registers awq)
from compiler.deploy.targets import TARGETS, Target, register_target
from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.formats.int8 import Int8Linear
from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from compiler.io.summary import artifact_summary
from compiler.pipeline import PassContext, Pipeline, PipelineConfig, PipelineValidationError
from compiler.pipeline.compile import compile_model
from compiler.quant.int4 import choose_qparams, quantize
from passes.awq import AWQPass, sensitivity_unit, stored_bits
from passes.awq_plan import AWQOptions
from passes.awq_search import refit_scales
from passes.distill.evaluate import compare_on_windows

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
CALIBRATION = {"samples": 4, "seq_len": 64}


def config(**awq) -> PipelineConfig:
    return PipelineConfig.from_dict({"calibration": CALIBRATION, "passes": [{"name": "awq", **awq}]})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, byte_tokenizer):
    from conftest import make_hf_model

    path = tmp_path_factory.mktemp("awq-mixed") / "tiny-llama"
    make_hf_model("llama", vocab_size=len(byte_tokenizer), **TINY).save_pretrained(path)
    byte_tokenizer.save_pretrained(path)
    return path


# AWQ's scales are all 1 (α = 0 alone, no duo scaling): the float model with one layer quantized is
# then the checkpoint with that layer swapped, which the test computes directly.
UNSCALED = dict(alpha_grid=1, duo_scaling="none", group_size=64)


@pytest.fixture(scope="module")
def kl_artifact(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("kl") / "art"
    return compile_model(checkpoint, config(**UNSCALED, sensitivity="kl", validation_windows=2), out)


def test_every_converted_row_carries_its_output_error(kl_artifact):
    report = kl_artifact.reports[0]
    rows = [r for r in report.layers if r.format != "float"]
    assert len(rows) == 14 and all(0 < r.metrics["output_error"] < 0.2 for r in rows)
    errors = [r.metrics["output_error"] for r in rows]
    assert report.metrics["mean_output_error"] == pytest.approx(sum(errors) / len(errors))
    assert report.metrics["max_output_error"] == max(errors)


@torch.no_grad()
def test_kl_alone_is_the_kl_of_that_layer_alone_quantized(kl_artifact, checkpoint):
    rows = {r.module: r for r in kl_artifact.reports[0].layers if r.format != "float"}
    assert all(r.metrics["kl_alone"] > 0 for r in rows.values())
    loaded = load_checkpoint(checkpoint)
    windows = PassContext(loaded.tokenizer, PipelineConfig.from_dict({"calibration": CALIBRATION}).calibration
                          ).validation_windows(2)
    for name in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"):  # the first measured, and a later one
        model = load_checkpoint(checkpoint).model
        model.set_submodule(name, kl_artifact.loaded.model.get_submodule(name))
        kl = compare_on_windows(loaded.model, model, windows)["kl"]
        assert rows[name].metrics["kl_alone"] == pytest.approx(kl, rel=1e-4)


def test_inspect_shows_the_most_sensitive_layers(kl_artifact):
    summary = artifact_summary(kl_artifact.path)
    worst = summary["sensitive"]
    rows = [r for r in kl_artifact.reports[0].layers if r.format != "float"]
    ranked = sorted(rows, key=lambda r: r.metrics["kl_alone"], reverse=True)[:10]
    assert [w["module"] for w in worst] == [r.module for r in ranked]
    assert worst[0]["kl_alone"] == ranked[0].metrics["kl_alone"] and worst[0]["pass"] == "awq"
    proc = subprocess.run([sys.executable, "-m", "qcompile", "inspect", str(kl_artifact.path)], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout[proc.stdout.index("most sensitive layers (by KL of the layer alone)"):]
    assert text.index(ranked[0].module) < text.index(ranked[1].module) < text.index("formats:")


def test_without_kl_the_worst_are_ranked_by_output_error(checkpoint, tmp_path):
    result = compile_model(checkpoint, config(group_size=64), tmp_path / "art")
    worst = artifact_summary(result.path)["sensitive"]
    errors = sorted((r.metrics["output_error"] for r in result.reports[0].layers if r.format != "float"), reverse=True)
    assert [w["output_error"] for w in worst] == errors[:10] and all(w["kl_alone"] is None for w in worst)


AVERAGE_BITS = 5.5  # INT4 g64 in float32 is 4.56 bits per weight: room for some INT8 units, not all


@torch.no_grad()
def test_average_bits_gives_int8_to_the_largest_gains_per_bit_within_the_budget(checkpoint):
    loaded = load_checkpoint(checkpoint)
    opts = AWQOptions(group_size=64, average_bits=AVERAGE_BITS)
    context = PassContext(loaded.tokenizer, config().calibration)
    stream = AWQPass(opts).stream(loaded.model, context)
    for i in range(len(loaded.model.layers)):
        stream.block(i)
    before = stream.average_bits()
    candidates = [(c.name, c.row.metrics["output_error"], c.error, c.extra_bits) for c in stream.wider]
    report = stream.finish()
    # the expected choice, greedily by error reduction per extra bit, unit by unit
    units = defaultdict(list)
    for name, narrow, wide, extra in candidates:
        units[sensitivity_unit(name, opts)].append((name, narrow - wide, extra))
    assert len(units) == 8 and len(units["layers.0.self_attn.qkv"]) == 3
    weights = sum(m.in_features * m.out_features for n, m in loaded.model.named_modules()
                  if isinstance(m, (Int4Linear, Int8Linear)))
    budget, spent, expected, skipped = (AVERAGE_BITS - before) * weights, 0.0, set(), []
    for members in sorted(units.values(), key=lambda u: sum(g for _, g, _ in u) / sum(e for _, _, e in u), reverse=True):
        extra = sum(e for _, _, e in members)
        if spent + extra > budget:
            skipped.append(extra)
            continue
        spent += extra
        expected |= {n for n, _, _ in members}
    chosen = {r.module for r in report.layers if r.format == "int8"}
    assert chosen == expected and 0 < len(chosen) < 14
    assert all(isinstance(loaded.model.get_submodule(n), Int8Linear) for n in chosen)
    # the measured bits per weight are within the budget, and no unit left out would still fit
    bits = sum(stored_bits(m) for m in loaded.model.modules() if isinstance(m, (Int4Linear, Int8Linear))) / weights
    assert bits <= AVERAGE_BITS and bits == pytest.approx(report.metrics["bits_per_weight"], abs=1e-4)
    assert skipped and all(bits * weights + extra > AVERAGE_BITS * weights for extra in skipped)
    note = next(n for n in report.notes if n.startswith(f"average_bits {AVERAGE_BITS}:"))
    assert f"{len(chosen)} of 14 layers in INT8" in note and f"all INT4: {before:.3f}" in note
    assert report.metrics["layers_int8"] == len(chosen)


@torch.no_grad()
def test_mixed_artifact_records_each_layers_format_and_reloads_with_the_same_logits(checkpoint, tmp_path):
    result = compile_model(checkpoint, config(group_size=64, average_bits=AVERAGE_BITS), tmp_path / "art")
    rows = {r.module: r for r in result.reports[0].layers if r.format != "float"}
    reloaded = load_artifact(result.path)
    modules = reloaded.manifest.modules
    assert {n: m["format"] for n, m in modules.items()} == {n: r.format for n, r in rows.items()}
    assert {"int4", "int8"} == {m["format"] for m in modules.values()}
    units = defaultdict(set)  # q/k/v and gate/up switch together: vLLM and the engine run each as one layer
    for name, m in modules.items():
        units[name.rsplit(".", 1)[0] + ("" if name.endswith(("o_proj", "down_proj")) else "*")].add(m["format"])
    assert len(units) == 8 and all(len(formats) == 1 for formats in units.values())
    int8 = [n for n, m in modules.items() if m["format"] == "int8"]
    assert all(modules[n]["activation_scheme"] == "none" and "int8 W8A16, measured sensitive" in rows[n].reason
               for n in int8)
    # the plan listed, before any work, the INT8 format each of them got (the target is checked for it)
    plan = Pipeline(config(group_size=64, average_bits=AVERAGE_BITS)).validate(reloaded.model.config)
    assert sorted(plan.alternatives) == sorted(modules)
    assert all(plan.alternatives[n] == modules[n] for n in int8)
    # the INT8 scales are float16 values, as the INT4 ones (vLLM's float16 checkpoint, GGUF's Q8_0 hold them)
    scales = torch.cat([reloaded.model.get_submodule(n).weight_scale for n in int8])
    assert torch.equal(scales.half().float(), scales)
    ids = torch.randint(0, reloaded.model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(7))
    assert torch.equal(reloaded.model(ids), result.loaded.model(ids))
    by_size = {layer["module"]: layer["bits_per_weight"] for layer in artifact_summary(result.path)["layers"]}
    assert all(by_size[n] > 8 for n in int8) and all(by_size[n] < 5 for n in rows if n not in int8)


@pytest.mark.parametrize("options,words", [
    ({"format": "gguf:q4_k_m", "average_bits": 5.0}, "average_bits mixes INT4 and INT8 layers"),
    ({"average_bits": 4.0}, "average_bits must be above INT4's 4 bits and at most INT8's 8"),
    ({"average_bits": 8.5}, "average_bits must be above INT4's 4 bits and at most INT8's 8"),
    ({"format": "gguf:q4_0", "scale_refit": True}, "GGUF block types keep llama.cpp's fields"),
])
def test_option_refusals(options, words):
    with pytest.raises(ConfigError, match=words):
        Pipeline(config(**options))


@pytest.mark.parametrize("awq,refused", [({"group_size": 64, "average_bits": 5.0}, "int8"),
                                         ({"format": "gguf:q4_k_m"}, "q6_k")])
def test_a_target_that_cannot_run_the_wider_format_is_refused_before_any_work(checkpoint, awq, refused):
    def check(module: str, fmt: dict) -> str | None:
        return f"no {refused} layers" if refused in (fmt["format"], fmt.get("block_type")) else None

    register_target(Target("test-no-wider", "runs no INT8 or Q6_K layers (test double)", check, lower=None))
    model_config = load_checkpoint(checkpoint).model.config
    try:
        d = {"calibration": CALIBRATION, "passes": [{"name": "awq", **awq}], "target": {"name": "test-no-wider"}}
        with pytest.raises(PipelineValidationError, match=rf"^pipeline \(the other format a pass may give a layer it "
                           rf"measures sensitive\): target 'test-no-wider' cannot run layers\.0\.\S+ \(and \d+ more "
                           rf"layers\): no {refused} layers$"):
            Pipeline(PipelineConfig.from_dict(d)).validate(model_config)
        # INT4 alone: nothing wider to refuse
        Pipeline(PipelineConfig.from_dict({**d, "passes": [{"name": "awq", "group_size": 64}]})).validate(model_config)
    finally:
        TARGETS.pop("test-no-wider")


def test_average_bits_below_int4s_own_bits_is_refused_in_one_line_before_any_work(checkpoint, tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[calibration]\nsamples = 4\nseq_len = 64\n[[passes]]\nname = "awq"\ngroup_size = 32\n'
                   'average_bits = 5.0\n')
    proc = subprocess.run([sys.executable, "-m", "qcompile", "compile", str(checkpoint), "-c", str(cfg), "-o",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "400"}, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "average_bits 5.0 is below the 5.125 bits per weight INT4 g32 takes" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options", [{"average_bits": 5.0}, {"sensitivity": "kl"}])
def test_whole_model_options_refuse_a_streamed_compile(checkpoint, tmp_path, options):
    with pytest.raises(ConfigError, match="pass awq needs the whole model in memory"):
        compile_model(checkpoint, config(group_size=64, **options), tmp_path / "art", streaming="on")


def test_refit_scales_is_each_rows_least_squares_fit():
    gen = torch.Generator().manual_seed(0)
    n, k, g = 6, 64, 16
    x = torch.randn(256, k, generator=gen) * torch.rand(k, generator=gen) * 3  # uneven channels
    h = x.T @ x / len(x)
    w = torch.randn(n, k, generator=gen)
    scale, zero = choose_qparams(w, g)
    levels = quantize(w, scale, zero, g).float() - zero.float().repeat_interleave(g, 1)
    fit = refit_scales(w, levels, scale, h, lambda s: s.float())
    for row in range(n):  # the design matrix of row's n_blocks scales, solved by lstsq on the tokens
        design = torch.zeros(k, k // g)
        design[torch.arange(k), torch.arange(k) // g] = levels[row]
        best = torch.linalg.lstsq((x @ design).double(), (x @ w[row]).double()[:, None]).solution[:, 0]
        assert torch.allclose(fit[row].double(), best, rtol=1e-4)
    def errors(s):
        delta = (levels.view(n, -1, g) * s[..., None]).view(n, k) - w
        return ((delta @ h) * delta).sum(1)
    stored = refit_scales(w, levels, scale, h, lambda s: s.half().float())  # rounded as a float32 artifact stores them
    assert (errors(stored) <= errors(scale)).all() and (errors(stored) < errors(scale)).any()
    kept = refit_scales(w, levels, scale, h, lambda s: -s)  # a fit made worse by its storage is not taken
    assert torch.equal(kept, scale)


def test_scale_refit_never_raises_a_layers_output_error(checkpoint, tmp_path):
    rows = {}
    for refit in (False, True):
        report = compile_model(checkpoint, config(group_size=64, average_bits=AVERAGE_BITS, scale_refit=refit),
                               tmp_path / str(refit)).reports[0]
        rows[refit] = {r.module: r for r in report.layers if r.format != "float"}
    before = {n: r.metrics["output_error"] for n, r in rows[False].items()}
    after = {n: r.metrics["output_error"] for n, r in rows[True].items() if r.format == rows[False][n].format}
    assert len(after) >= 10 and all(after[n] <= before[n] * (1 + 1e-6) for n in after), [
        (n, before[n], after[n]) for n in after if after[n] > before[n]]
    assert sum(after.values()) < sum(before[n] for n in after)


@torch.no_grad()
def test_with_kl_sensitivity_int8_goes_to_the_units_removing_most_end_to_end_kl_per_bit(checkpoint):
    loaded, teacher = load_checkpoint(checkpoint), load_checkpoint(checkpoint).model
    opts = AWQOptions(**UNSCALED, average_bits=AVERAGE_BITS, sensitivity="kl", validation_windows=2)
    context = PassContext(loaded.tokenizer, config().calibration)
    windows = context.validation_windows(2)
    stream = AWQPass(opts).stream(loaded.model, context)
    for i in range(len(loaded.model.layers)):
        stream.block(i)
    units = defaultdict(list)
    for c in stream.wider:
        units[sensitivity_unit(c.name, opts)].append(c)
    base = compare_on_windows(teacher, loaded.model, windows)["kl"]
    gains = {}
    for key, members in units.items():  # unscaled AWQ: the float model is the checkpoint itself
        student = copy.deepcopy(loaded.model)
        for c in members:
            student.set_submodule(c.name, c.module)
        gains[key] = (base - compare_on_windows(teacher, student, windows)["kl"]) / sum(c.extra_bits for c in members)
    weights = sum(c.module.in_features * c.module.out_features for c in stream.wider)
    budget, spent, expected = (AVERAGE_BITS - stream.average_bits()) * weights, 0.0, set()
    for key in sorted(gains, key=gains.get, reverse=True):
        extra = sum(c.extra_bits for c in units[key])
        if spent + extra <= budget and gains[key] > 0:
            spent += extra
            expected |= {c.name for c in units[key]}
    report = stream.finish()
    chosen = {r.module for r in report.layers if r.format == "int8"}
    assert chosen == expected and chosen
    assert any("KL from float it removes" in n for n in report.notes)
