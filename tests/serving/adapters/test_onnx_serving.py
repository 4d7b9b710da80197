"""The ONNX Runtime and Ascend serving adapters (the latter over an ONNX Runtime session double)."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx_helpers import make_artifact

from backends.ascend.atc import AtcOptions
from backends.ascend.lower import lower_ascend
from backends.onnx.export import OnnxExportOptions, export_onnx
from compiler.errors import ConfigError
from compiler.io.artifact import load_artifact
from compiler.kernels.int4_cpu import reference_only
from serving.adapters.ascend import (
    AscendAdapter,
    BackendUnavailable,
    ais_bench_factory,
    npu_device,
)
from serving.adapters.onnx import OnnxRuntimeAdapter
from serving.request import Request
from serving.types import SamplingParams

DOUBLES = Path(__file__).resolve().parents[2] / "doubles"


def collect(adapter, prompt, params):
    async def run():
        return [e async for e in adapter.generate(prompt, params)]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def artifact_with_tokenizer(tmp_path_factory, byte_tokenizer):
    tmp = tmp_path_factory.mktemp("serve")
    return make_artifact(tmp, "llama", 32, tokenizer=byte_tokenizer, vocab_size=len(byte_tokenizer))


@pytest.fixture(scope="module")
def onnx_bundle(artifact_with_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "onnx"
    export_onnx(load_artifact(artifact_with_tokenizer), out, OnnxExportOptions(max_len=128, accuracy_level=0))
    return out


def test_onnx_adapter_greedy_stream_matches_torch(artifact_with_tokenizer, onnx_bundle):
    loaded = load_artifact(artifact_with_tokenizer)
    prompt = "def fibonacci(n):"
    ids = loaded.tokenizer(prompt)["input_ids"]
    with reference_only():  # the bundle computes in float32 (accuracy_level 0), as the dequantize reference
        expected = loaded.model.generate(torch.tensor([ids]), 20)[0, len(ids):].tolist()
    events = collect(OnnxRuntimeAdapter(onnx_bundle, threads=1), prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == expected
    assert [e.finish_reason for e in events] == [None] * 19 + ["length"]
    assert "".join(e.text for e in events) == loaded.tokenizer.decode(expected, skip_special_tokens=True)


def test_onnx_adapter_stop_string_and_seeded_sampling(onnx_bundle):
    adapter = OnnxRuntimeAdapter(onnx_bundle, threads=1)
    greedy = collect(adapter, "import os", SamplingParams(max_tokens=12, ignore_eos=True))
    text = "".join(e.text for e in greedy)
    stop = text.strip()[3:6] or text[:2]
    stopped = collect(adapter, "import os", SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    assert stopped[-1].finish_reason == "stop" and stop not in "".join(e.text for e in stopped)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    a = [t for e in collect(adapter, "import os", params) for t in e.token_ids]
    b = [t for e in collect(adapter, "import os", params) for t in e.token_ids]
    assert a == b and len(a) == 10


# Requests of different prompt lengths and budgets: some finish early, so rows leave while others run
# and waiting requests join between steps (max_batch 4); one samples with a seed (a test adds one that
# stops on a string).
REQUESTS = [([5, 17, 99, 3], SamplingParams(max_tokens=14, ignore_eos=True)),
            ("def fibonacci(n):", SamplingParams(max_tokens=20, ignore_eos=True)),
            (list(range(40, 71)), SamplingParams(max_tokens=3, ignore_eos=True)),
            ("import os", SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=3, ignore_eos=True)),
            ([7] * 12, SamplingParams(max_tokens=17, ignore_eos=True)),
            ("class A:", SamplingParams(max_tokens=11, ignore_eos=True))]


def serve_concurrently(adapter, requests):
    async def run():
        return await asyncio.gather(*(collect_async(adapter, prompt, params) for prompt, params in requests))

    return asyncio.run(run())


async def collect_async(adapter, prompt, params):
    return [e async for e in adapter.generate(prompt, params)]


def test_onnx_adapter_batches_concurrent_requests_as_one_at_a_time(onnx_bundle):
    """Six requests at once through continuous batching (at most 4 rows decoding together) stream the
    same tokens, text and finish reasons as each served alone."""
    alone = OnnxRuntimeAdapter(onnx_bundle, threads=1)
    text = "".join(e.text for e in collect(alone, *REQUESTS[5]))
    requests = REQUESTS + [(REQUESTS[5][0], SamplingParams(max_tokens=11, ignore_eos=True, stop=(text[4:6],)))]
    expected = [collect(alone, prompt, params) for prompt, params in requests]
    batched = OnnxRuntimeAdapter(onnx_bundle, threads=1, max_batch=4)
    got = serve_concurrently(batched, requests)
    assert got == expected
    assert batched.batcher.largest_batch == 4 and alone.batcher.largest_batch == 1
    assert not batched.batcher.running and not batched.batcher.waiting
    assert [len(events) for events in got[:6]] == [14, 20, 3, 9, 17, 11]
    assert got[6][-1].finish_reason == "stop" and len(got[6]) < 11


def test_onnx_adapter_frees_the_row_of_a_request_left_early(onnx_bundle):
    """A consumer that stops reading after two tokens gives its row back (it is decoded no further);
    the others are unchanged."""
    adapter = OnnxRuntimeAdapter(onnx_bundle, threads=1, max_batch=2)
    expected = [collect(adapter, prompt, params) for prompt, params in REQUESTS[:3]]
    decoded_rows = []
    decode_rows = adapter.runner.decode_rows
    adapter.runner.decode_rows = lambda cache, ids, past: decoded_rows.append(len(ids)) or decode_rows(cache, ids, past)

    async def leave_early():
        stream = adapter.generate(*REQUESTS[4])
        events = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return events

    async def run():
        return await asyncio.gather(leave_early(), *(collect_async(adapter, p, q) for p, q in REQUESTS[:3]))

    early, *got = asyncio.run(run())
    assert got == expected and len(early) == 2
    assert not adapter.batcher.running and not adapter.batcher.waiting
    # every other request decodes (tokens - 1) rows; the one that left, at most its 2 tokens and one step in flight
    assert sum(decoded_rows) <= sum(len(e) - 1 for e in expected) + 2


def test_onnx_adapter_delivers_a_runtime_failure_to_every_request(onnx_bundle, monkeypatch):
    adapter = OnnxRuntimeAdapter(onnx_bundle, threads=1)

    def broken(*args):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(adapter.runner, "decode_rows", broken)

    async def run():
        results = asyncio.gather(*(collect_async(adapter, p, q) for p, q in REQUESTS[:3]), return_exceptions=True)
        return await asyncio.wait_for(results, timeout=60)

    assert [str(r) for r in asyncio.run(run())] == ["decode failed"] * 3


def test_onnx_adapter_refuses_a_prompt_that_does_not_fit_and_aborts_on_close(onnx_bundle):
    adapter = OnnxRuntimeAdapter(onnx_bundle, threads=1)
    with pytest.raises(ConfigError, match="does not fit the cache"):
        collect(adapter, [3] * 128, SamplingParams(max_tokens=4))

    async def close_midway():
        stream = adapter.generate(*REQUESTS[1])
        first = await stream.__anext__()
        await adapter.close()
        return [first] + [e async for e in stream]

    events = asyncio.run(asyncio.wait_for(close_midway(), timeout=30))  # without the abort it would wait forever
    assert events[-1].finish_reason == "abort" and len(events) < 20


def test_onnx_adapter_standard_attention_bundle_serves_one_at_a_time(artifact_with_tokenizer, onnx_bundle, tmp_path):
    """A --no-fused-attention bundle (one length per batch) has no batcher: concurrent requests queue,
    and stream what the batched adapter streams."""
    export_onnx(load_artifact(artifact_with_tokenizer), tmp_path / "standard",
                OnnxExportOptions(max_len=128, accuracy_level=0, fused_attention=False))
    standard = OnnxRuntimeAdapter(tmp_path / "standard", threads=1)
    assert standard.batcher is None
    assert serve_concurrently(standard, REQUESTS[:4]) == serve_concurrently(OnnxRuntimeAdapter(onnx_bundle, threads=1),
                                                                             REQUESTS[:4])


def test_sampling_filters():
    """The one sampler (``serving.sampling``), on logits as an adapter's runtime gives them (NumPy)."""
    request = Request("r", [1], SamplingParams(temperature=1.0, top_k=1, seed=0), [], None)
    logits = np.array([0.0, 3.0, 1.0, 2.9], np.float32)
    assert request.sample(logits) == 1
    assert Request("r", [1], SamplingParams(temperature=1.0, top_p=0.01), [], None).sample(logits) == 1
    top2 = Request("r", [1], SamplingParams(temperature=1.0, top_k=2, seed=0), [], None)
    assert {top2.sample(logits) for _ in range(200)} == {1, 3}


class OrtOmSessionDouble:
    """TEST DOUBLE for ais_bench's InferSession: runs the bundle's ONNX graph in ONNX Runtime
    instead of the .om (same inputs and outputs, which is what the adapter's logic depends on)."""

    def __init__(self, onnx_path: Path):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]
        self.calls: list[list[tuple]] = []

    def infer(self, feeds):
        self.calls.append([f.shape for f in feeds])
        return self.session.run(None, dict(zip(self.names, feeds)))


@pytest.mark.integration
def test_ascend_adapter_buckets_and_kv_cache(tmp_path, monkeypatch):
    artifact = make_artifact(tmp_path, "llama", 32)
    bundle = tmp_path / "ascend"
    monkeypatch.setenv("PATH", f"{DOUBLES}:{os.environ['PATH']}")
    monkeypatch.setenv("ATC_DOUBLE_LOG", str(tmp_path / "atc.jsonl"))
    lower_ascend(load_artifact(artifact), bundle, AtcOptions("Ascend910B3", (16, 32, 64)), max_len=96)
    sessions = {}

    def factory(om_path: Path, dynamic: bool):
        graph = "prefill" if dynamic else "decode"
        assert om_path.name == f"{graph}.om"
        sessions[graph] = OrtOmSessionDouble(bundle / f"{graph}.onnx")
        return sessions[graph]

    adapter = AscendAdapter(bundle, session_factory=factory)
    loaded = load_artifact(artifact)
    prompt = torch.randint(0, loaded.model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(3))
    expected = loaded.model.generate(prompt, 24)[0, 11:].tolist()
    events = collect(adapter, prompt[0].tolist(), SamplingParams(max_tokens=24, ignore_eos=True))
    assert [t for e in events for t in e.token_ids] == expected
    assert sessions["prefill"].calls == [[(1, 16)]]  # 11 tokens padded to the 16 gear
    assert len(sessions["decode"].calls) == 23
    with pytest.raises(Exception, match="largest prefill gear 64"):
        collect(adapter, [1] * 65, SamplingParams(max_tokens=1))


def test_ascend_adapter_unavailable_without_cann():
    if __import__("importlib").util.find_spec("ais_bench") is not None:
        pytest.skip("ais_bench is installed here")
    with pytest.raises(BackendUnavailable, match="ais_bench"):
        ais_bench_factory()


def test_torch_npu_only_imported_when_asked():
    assert "torch_npu" not in sys.modules
    if __import__("importlib").util.find_spec("torch_npu") is None:
        with pytest.raises(BackendUnavailable, match="torch_npu"):
            npu_device()
    assert json.dumps(sorted(m for m in sys.modules if m.startswith("torch_npu"))) == "[]"


def test_example_onnx_stage(artifact_with_tokenizer, tmp_path):
    from rich.console import Console

    from qcompile.cli.example.onnx import run_onnx_stage

    console = Console(record=True, width=200)
    rows = [{"variant": "int4-rtn", "path": str(artifact_with_tokenizer)}]
    (result,) = run_onnx_stage(console, rows, tmp_path, "def fibonacci(n):")
    assert result["rel_error"] < 1e-4 and result["greedy_same"]
    assert "MatMulNBits" in result["layers"] and "identical" in console.export_text()


def test_example_onnx_stage_picks_float_and_first_int4(artifact_with_tokenizer, tmp_path):
    from qcompile.cli.example.onnx import stage_rows

    float_artifact = make_artifact(tmp_path, "llama")
    rows = [{"variant": "float", "path": str(float_artifact)}, {"variant": "plain", "path": str(float_artifact)},
            {"variant": "int4-a", "path": str(artifact_with_tokenizer)}, {"variant": "int4-b", "path": str(artifact_with_tokenizer)}]
    assert [r["variant"] for r in stage_rows(rows)] == ["float", "int4-a"]
