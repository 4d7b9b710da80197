"""``qcompile example``'s variants: each pipeline on its own input, and a table that shows each beside it."""
import io
from pathlib import Path

import pytest
from conftest import make_hf_model
from rich.console import Console

import passes  # noqa: F401  (registers the passes the pipelines name)
from compiler.io.artifact import read_manifest
from compiler.io.load import load_checkpoint
from compiler.model.config import ModelConfig
from compiler.pipeline import Pipeline, PipelineConfig
from qcompile.cli.console import LOG_WIDTH
from qcompile.cli.example import variants as example_variants
from qcompile.cli.example.variants import VARIANTS, Variant, compile_variants, example_pipeline, variants_table

SMOLLM2_LIKE = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, dim=576, n_layers=2, n_heads=9,
                           n_kv_heads=3, intermediate_size=1536)


def test_shipped_variants_start_from_the_row_before_them():
    labels = [v.label for v in VARIANTS]
    assert len(set(labels)) == len(labels) and VARIANTS[0].start is None
    for i, v in enumerate(VARIANTS):
        if v.start:
            assert labels[i - 1] == v.start, f"{v.label} should come right after its input {v.start}"
    assert any(v.start and v.pipeline == "distill_int4.toml" for v in VARIANTS)


def test_shipped_pipelines_validate_on_their_input():
    for v in VARIANTS:
        config = PipelineConfig.from_toml(example_pipeline(v.pipeline))
        formats = Pipeline(config).validate(SMOLLM2_LIKE).formats
        if v.start:  # runs on an artifact: plans no new formats, keeps its input's
            assert formats == {} and [p["name"] for p in config.passes] == ["distill"]


def test_every_shipped_pipeline_validates_on_smollm2():
    """The pipelines beside the example's (those compiled for vLLM or Ascend) pass their [target]'s checks too."""
    folder = example_pipeline("float.toml").parent
    shipped = sorted(p.name for p in folder.glob("*.toml"))
    assert {"awq_g128_vllm.toml", "fp8_vllm.toml", "int8_w8a8_c8.toml"} <= set(shipped)
    for name in shipped:
        config = PipelineConfig.from_toml(folder / name)
        assert Pipeline(config).validate(SMOLLM2_LIKE) is not None, name


@pytest.fixture(scope="module")
def tiny_variants(tmp_path_factory, byte_tokenizer):
    """float, AWQ and AWQ + distill on a tiny checkpoint, from pipeline files in a temporary folder
    (compiled once for the tests below)."""
    tmp = tmp_path_factory.mktemp("example")
    src = tmp / "tiny-llama-tok"
    make_hf_model("llama", vocab_size=len(byte_tokenizer)).save_pretrained(src)
    byte_tokenizer.save_pretrained(src)
    files = {
        "float.toml": "[calibration]\nsamples = 4\nseq_len = 32\n",
        "awq.toml": '[calibration]\nsamples = 4\nseq_len = 32\n[[passes]]\nname = "awq"\ngroup_size = 32\n',
        "distill.toml": f'[[passes]]\nname = "distill"\nteacher = "{src}"\nsteps = 2\nseq_len = 32\nbatch_size = 2\n'
                        'block_epochs = 1\nblock_sequences = 4\ne2e_params = "scales"\neval_windows = 1\neval_len = 64\n',
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    variants = [Variant("float", "float.toml"), Variant("awq", "awq.toml"),
                Variant("awq+distill", "distill.toml", start="awq")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(example_variants, "example_pipeline", lambda name: tmp / name)
        return compile_variants(Console(file=io.StringIO()), load_checkpoint(src), tmp / "out", 1, variants)


def test_distilled_variant_starts_from_the_awq_artifact(tiny_variants):
    float_row, awq, distilled = tiny_variants
    assert [r["from"] for r in tiny_variants] == [None, None, "awq"]
    manifest = read_manifest(distilled["path"])
    assert manifest.source.kind == "artifact" and manifest.source.path == str(Path(awq["path"]).resolve())
    assert [p["name"] for p in manifest.reports] == ["awq", "distill"]  # the input's passes, then its own
    assert [p["name"] for p in read_manifest(awq["path"]).reports] == ["awq"]  # its input is left as it was
    assert all(m["format"] == "int4" for name, m in manifest.modules.items() if name != "lm_head")
    kl = manifest.reports[-1]["metrics"]
    assert distilled["stage"].startswith(f"KL to teacher {kl['kl_before']:.4f} → {kl['kl_after']:.4f}")
    assert float_row["stage"] == awq["stage"] == ""


def test_table_shows_each_variant_beside_its_input_whole(tiny_variants):
    float_row, awq, distilled = tiny_variants
    out = io.StringIO()
    Console(file=out, width=LOG_WIDTH).print(variants_table(tiny_variants, "tiny", "tiny-llama"))
    lines = {line.split()[1]: line for line in out.getvalue().splitlines() if line.startswith("│")}
    assert "…" not in out.getvalue()
    distilled_line = lines["awq+distill"]
    vs_float = f"{100 * (distilled['ppl'] / float_row['ppl'] - 1):+.2f}%"
    vs_awq = f"{100 * (distilled['ppl'] / awq['ppl'] - 1):+.2f}%"
    assert vs_float in distilled_line and vs_awq in distilled_line and distilled["stage"] in distilled_line
    assert distilled_line.split("│")[2].strip() == "awq" and lines["awq"].split("│")[2].strip() == "tiny-llama"
    for r in tiny_variants:
        assert r["path"] in lines[r["variant"]]


@pytest.mark.integration
def test_llama_cpp_stage_serves_the_int4_artifact_in_llama_cpp(tiny_variants, tmp_path):
    from backends.gguf.llama_cpp import missing_reason
    from qcompile.cli.example.llama_cpp import run_llama_cpp_stage

    if missing_reason():
        pytest.skip(missing_reason())
    out = io.StringIO()
    same = run_llama_cpp_stage(Console(file=out, width=LOG_WIDTH), tiny_variants, tmp_path, "def f(x):")
    text = out.getvalue()
    assert same in (True, False) and "llama.cpp stream (127.0.0.1:" in text and "awq.gguf" in text
    assert (tmp_path / "awq.gguf").stat().st_size > 0
