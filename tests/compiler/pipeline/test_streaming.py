"""Streamed compiles (one decoder block at a time) against in-memory ones, and the memory plan
that stops a compile before any work."""
from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import pytest
import torch

import compiler.io.shards as shards
import passes  # noqa: F401  (registers the passes)
from compiler.errors import ConfigError
from compiler.io.artifact import load_artifact
from compiler.io.checkpoint import hf_config
from compiler.io.load import load_checkpoint
from compiler.io.stream import BlockReader, StreamedCheckpoint
from compiler.pipeline import Pipeline, PipelineConfig
from compiler.pipeline.compile import compile_loaded, compile_model
from compiler.model.transformer import Transformer
from compiler.pipeline.memory import RUNTIME_BYTES, MemoryPlanError, format_size, parse_size, plan_memory
from compiler.pipeline.selection import meta_model
from passes.awq_plan import plan_layers

from call_recorder import record_calls, record_calls_everywhere

TINY = dict(num_hidden_layers=3)  # conftest's tiny Llama otherwise: hidden 64, GQA 4 heads on 2
CALIB = {"samples": 6, "seq_len": 32}  # and a small corpus (``small_corpus``): tokenizing pydoc dominates otherwise
PIPELINES = {
    "awq": [{"name": "awq", "group_size": 32, "alpha_grid": 4, "clip_grid": 4}],
    # static scales, the FP8 KV cache and a config-only pass after it (it reads the KV entry)
    "fp8": [{"name": "fp8", "activation_scheme": "static", "kv_cache_dtype": "float8_e4m3fn"}, {"name": "paged_kv"}],
}


@pytest.fixture(scope="module", autouse=True)
def small_corpus(tmp_path_factory):
    from calib import load_corpus_text

    path = tmp_path_factory.mktemp("corpus") / "calib.txt"
    path.write_text(load_corpus_text("pydoc")[:30_000])
    CALIB["corpus"] = str(path)
    yield
    del CALIB["corpus"]


def pipeline(name: str, **calibration) -> PipelineConfig:
    return PipelineConfig.from_dict({"calibration": {**CALIB, **calibration}, "passes": PIPELINES[name]})


@pytest.fixture
def same_clock(monkeypatch):
    """Wall times and the creation time are the only things two compiles may not share."""
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    monkeypatch.setattr(time, "strftime", lambda *_: "2026-12-01T00:00:00Z")


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_streamed_artifact_is_byte_for_byte_the_in_memory_one(tiny_checkpoint_with_tokenizer, tmp_path, same_clock,
                                                               name):
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    in_memory = compile_model(src, pipeline(name), tmp_path / "memory", streaming="off")
    streamed = compile_model(src, pipeline(name), tmp_path / "streamed", streaming="on")
    assert not in_memory.streamed and streamed.streamed and streamed.loaded is None
    expected, got = files(tmp_path / "memory"), files(tmp_path / "streamed")
    assert list(got) == list(expected)
    different = [f for f in expected if got[f] != expected[f]]
    assert not different, f"streamed and in-memory artifacts differ in {different}"
    # The streamed artifact reloads and computes what the compiled in-memory model computes.
    reloaded = load_artifact(tmp_path / "streamed")
    ids = torch.randint(0, reloaded.model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids), in_memory.loaded.model(ids))
    formats = {m["format"] for m in reloaded.manifest.modules.values()}
    assert formats == {"int4" if name == "awq" else "fp8"}


@pytest.fixture
def tiny_gguf(byte_tokenizer, tmp_path):
    """Factory: a tiny model (conftest's Llama, or an ``arch_helpers`` case) written as llama.cpp
    writes GGUF, with its tokenizer; ``quant``: its matrices' type (float32 when None)."""
    from arch_helpers import make_arch_model
    from conftest import make_hf_model
    from gguf_helpers import write_gguf

    def make(quant: str | None = None, case: str = "llama"):
        path = tmp_path / f"tiny-{case}-{quant or 'F32'}.gguf"
        vocab = len(byte_tokenizer)
        hf = (make_hf_model("llama", vocab_size=vocab, **TINY) if case == "llama"
              else make_arch_model(case, vocab_size=vocab, num_hidden_layers=2))
        write_gguf(path, hf, tokenizer=byte_tokenizer, quant=quant)
        return path

    return make


@pytest.mark.parametrize("quant, name, case", [("Q4_1", "awq", "llama"), ("Q8_0", "fp8", "llama"),
                                               (None, "awq", "llama"), ("Q8_0", "awq", "qwen3-moe")])
def test_streamed_gguf_is_byte_for_byte_the_in_memory_one(tiny_gguf, tmp_path, same_clock, quant, name, case):
    """A GGUF file streams too: its tensors read and dequantized one by one (q/k rows unpermuted,
    a MoE layer's stacked experts split), to the same bytes as the whole-file load."""
    src = tiny_gguf(quant, case)
    in_memory = compile_model(src, pipeline(name), tmp_path / "memory", streaming="off")
    streamed = compile_model(src, pipeline(name), tmp_path / "streamed", streaming="on")
    assert streamed.streamed and not in_memory.streamed
    expected, got = files(tmp_path / "memory"), files(tmp_path / "streamed")
    assert list(got) == list(expected)
    assert [f for f in expected if got[f] != expected[f]] == []
    reloaded = load_artifact(tmp_path / "streamed")
    assert reloaded.manifest.source.kind == "gguf" and reloaded.tokenizer is not None


@pytest.mark.parametrize("case", ["qwen3-moe", "gemma3", "deepseek-v3"])
def test_streamed_awq_matches_in_memory_beyond_the_llama_family(byte_tokenizer, tmp_path, same_clock, case):
    """Every expert's smoothing, the starved-expert policy, Gemma's norm placement and MLA's
    projections stream too: the same bytes as the whole model in memory."""
    from arch_helpers import make_arch_model

    src = tmp_path / case
    make_arch_model(case, vocab_size=len(byte_tokenizer)).save_pretrained(src)
    byte_tokenizer.save_pretrained(src)
    awq = PipelineConfig.from_dict({"calibration": CALIB, "passes": [
        {"name": "awq", "group_size": 32, "alpha_grid": 2, "clip_grid": 2, "starved_experts": "all_tokens"}]})
    in_memory = compile_model(src, awq, tmp_path / "memory", streaming="off")
    streamed = compile_model(src, awq, tmp_path / "streamed", streaming="on")
    assert streamed.streamed and not in_memory.streamed
    expected, got = files(tmp_path / "memory"), files(tmp_path / "streamed")
    assert [f for f in expected if got.get(f) != expected[f]] == []


def test_sharded_artifacts_match_and_reload(tiny_checkpoint_with_tokenizer, tmp_path, same_clock, monkeypatch):
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    monkeypatch.setattr(shards, "SHARD_BYTES", 30_000)  # the tiny artifact's ~200 kB in several shards
    compile_model(src, pipeline("awq"), tmp_path / "memory", streaming="off")
    compile_model(src, pipeline("awq"), tmp_path / "streamed", streaming="on")
    expected, got = files(tmp_path / "memory"), files(tmp_path / "streamed")
    assert shards.INDEX in got and sum(n.startswith("model-0") for n in got) > 2
    assert got == expected
    reloaded = load_artifact(tmp_path / "streamed")
    assert reloaded.source.size_bytes == sum(len(b) for n, b in got.items() if n.endswith(".safetensors"))


def mapped(path) -> bool:
    """Whether this process maps checkpoint ``path`` (a file, or a directory's safetensors files):
    a map kept open counts every page read so far in the process's memory."""
    gc.collect()
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_streamed_compile_holds_one_block_at_a_time(tiny_checkpoint_with_tokenizer, tiny_gguf, tmp_path, monkeypatch,
                                                    source):
    src = tiny_checkpoint_with_tokenizer("llama", **TINY)[0] if source == "safetensors" else tiny_gguf("Q8_0")
    read = BlockReader.block
    blocks: list[weakref.ref] = []

    def block(self, index):
        gc.collect()
        alive = [i for i, ref in enumerate(blocks) if ref() is not None]
        assert not alive, f"reading block {index} while block(s) {alive} are still in memory"
        assert not mapped(src), f"{src.name} is still mapped"
        layer = read(self, index)
        blocks.append(weakref.ref(layer.input_layernorm.weight))  # a tensor the pass keeps (it scales it in place)
        return layer

    monkeypatch.setattr(BlockReader, "block", block)
    compile_model(src, pipeline("awq"), tmp_path / "out", streaming="on")
    assert len(blocks) == TINY["num_hidden_layers"]


@pytest.mark.parametrize("way", ["in memory", "streamed", "already loaded"])
def test_a_compile_validates_once_and_plans_once(tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch, way):
    """One way through a compile: the pipeline is built and validated once, and the meta model, the
    layer plan and the memory plan are made once and handed down, not worked out again by each check."""
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    loaded = load_checkpoint(src) if way == "already loaded" else None
    built, validated = record_calls(monkeypatch, Pipeline, "__init__"), record_calls(monkeypatch, Pipeline, "validate")
    planned = {f.__name__: record_calls_everywhere(monkeypatch, f) for f in (meta_model, plan_layers, plan_memory)}
    if loaded:
        compile_loaded(loaded, pipeline("awq"), tmp_path / "out")
    else:
        result = compile_model(src, pipeline("awq"), tmp_path / "out", streaming="on" if way == "streamed" else "off")
        assert result.streamed == (way == "streamed")
    assert (len(built), len(validated)) == (1, 1)
    assert {name: len(calls) for name, calls in planned.items()} == {"meta_model": 1, "plan_layers": 1, "plan_memory": 1}


def test_a_compile_that_will_not_fit_stops_before_any_work(tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch):
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)

    def no_work(*args, **kwargs):
        raise AssertionError("the compile started work before refusing")

    monkeypatch.setattr("compiler.pipeline.compile.load_checkpoint", no_work)
    monkeypatch.setattr(StreamedCheckpoint, "__init__", no_work)
    # 2 x 256 samples x 512 tokens x 128 hidden x 4 bytes = 128 MiB of activations, streamed or not
    big = pipeline("awq", samples=256, seq_len=512)
    for streaming in ("auto", "on", "off"):
        with pytest.raises(MemoryPlanError) as e:
            compile_model(src, big, tmp_path / "out", streaming=streaming, memory_limit=RUNTIME_BYTES + 64 * 2**20)
        message = str(e.value)
        assert "\n" not in message
        assert "needs about" in message and f"memory limit of {format_size(RUNTIME_BYTES + 64 * 2**20)}" in message
        assert "calibration activations" in message and "samples (256) or seq_len (512)" in message
    assert not (tmp_path / "out").exists()


def test_auto_streams_when_only_the_streamed_plan_fits(tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch):
    # In memory the plan holds 6 blocks of 120 kB, streamed 2 of them.
    src, _ = tiny_checkpoint_with_tokenizer("llama", **{**TINY, "num_hidden_layers": 6})
    monkeypatch.setitem(PIPELINES, "awq", [{**PIPELINES["awq"][0], "weight_rounding": "nearest"}])  # faster
    p = Pipeline(pipeline("awq"))
    model = meta_model(hf_config(src))
    in_memory = plan_memory(p.passes, model, p.config.calibration, torch.float32, streamed=False).total
    streamed = plan_memory(p.passes, model, p.config.calibration, torch.float32, streamed=True).total
    assert streamed < in_memory
    limit = (streamed + in_memory) // 2
    assert compile_model(src, pipeline("awq"), tmp_path / "auto", memory_limit=limit).streamed
    assert not compile_model(src, pipeline("awq"), tmp_path / "roomy").streamed
    with pytest.raises(MemoryPlanError, match="compile streamed \\(--streaming on\\)"):
        compile_model(src, pipeline("awq"), tmp_path / "off", streaming="off", memory_limit=limit)


@pytest.mark.parametrize("tied", [True, False])
def test_the_plan_counts_a_quantized_lm_head(tiny_checkpoint_with_tokenizer, tied):
    # a vocabulary wide enough that the head (1024 x 64) is AWQ's widest scaling group
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY, vocab_size=1024, tie_word_embeddings=tied)
    model = meta_model(hf_config(src))

    def awq_terms(**options):
        p = Pipeline(PipelineConfig.from_dict({"calibration": CALIB, "passes": [{**PIPELINES["awq"][0], **options}]}))
        return plan_memory(p.passes, model, p.config.calibration, torch.float32, streamed=True).passes["awq"]

    float_head, int4_head = awq_terms(), awq_terms(modules_to_not_convert=[])
    assert float_head["scale and clip search"] < int4_head["scale and clip search"] == 4 * 1024 * 64 * 4
    assert int4_head.get("untied lm_head") == (1024 * 64 * 4 if tied else None) and "untied lm_head" not in float_head


@pytest.mark.parametrize("name, term, bytes_per_weight", [("awq", "INT4 weights (every block)", 0.5 + 5 / 32),  # g32
                                                           ("fp8", "FP8 weights (every block)", 1)])
def test_an_in_memory_plan_counts_the_converted_weights_beside_the_float_ones(tiny_checkpoint_with_tokenizer, name,
                                                                             term, bytes_per_weight):
    """In memory, the float weights stay mapped until the compile ends: the converted ones add to them."""
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    config = hf_config(src)
    p = Pipeline(PipelineConfig.from_dict({"calibration": CALIB, "passes": PIPELINES[name]}))
    in_memory, streamed = (plan_memory(p.passes, meta_model(config), p.config.calibration, torch.float32,
                                       streamed=s).passes[name] for s in (False, True))
    block = sum(t.numel() for t in Transformer(config).layers[0].parameters())
    assert in_memory[term] == int(config.n_layers * block * bytes_per_weight) and term not in streamed


def test_what_cannot_stream_says_why(tiny_checkpoint_with_tokenizer, tmp_path):
    src, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    distill = PipelineConfig.from_dict({"passes": [{"name": "distill", "steps": 1}]})
    with pytest.raises(ConfigError, match="cannot stream: pass distill needs the whole model"):
        compile_model(src, distill, tmp_path / "d", streaming="on")
    head = PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": "fp8", "modules_to_not_convert": []}]})
    with pytest.raises(ConfigError, match="pass fp8 needs the whole model"):
        compile_model(src, head, tmp_path / "h", streaming="on")
    artifact = compile_model(src, PipelineConfig(), tmp_path / "float").path
    with pytest.raises(ConfigError, match="not a Hugging Face checkpoint directory"):
        compile_model(artifact, pipeline("awq"), tmp_path / "again", streaming="on")
    with pytest.raises(ConfigError, match="streaming must be auto, on or off"):
        compile_model(src, pipeline("awq"), tmp_path / "x", streaming="yes")


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5g", int(1.5 * 2**30)),
                                           ("16GB", 16 * 10**9), ("1024", 1024)])
def test_memory_sizes_parse(text, expected):
    assert parse_size(text) == expected


def test_a_bad_memory_size_is_one_line():
    with pytest.raises(ConfigError, match="give a number with a unit, e.g. 4GiB"):
        parse_size("lots")
