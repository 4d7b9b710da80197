"""End to end with the real Triton Inference Server: tiny model -> compile -> lower -> ``qcompile serve``.

One server for the whole module (start-up takes ~20 s on 2 cores). Every token stream is compared
with the in-process engine's greedy output on the same artifact.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import make_byte_tokenizer, make_hf_model

pytestmark = pytest.mark.integration

MODEL = "tiny"  # float; the bad-request tests use it
MODELS = ("tiny", "tiny-int4")  # float and AWQ INT4, served side by side from one repository
PROMPTS = ["def f(x):", "import os", "class A:\n    pass", "x = 1", "for i in range(10):", "return None", "while True:",
           "print('hello')"]
MAX_TOKENS = [12, 7, 16, 3, 10, 5, 14, 9]
CONTEXT = 1024
TOO_LONG = "a b c d " * (CONTEXT // 4)  # the byte tokenizer: twice the context


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """The tiny model compiled twice: float, and AWQ INT4 (group 32)."""
    import backends  # noqa: F401  (the triton target, checked by the pipeline)
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    root = tmp_path_factory.mktemp("triton")
    tok = make_byte_tokenizer()
    # A long context, so that the cancelled stream below cannot finish before its cancellation arrives
    # even on a loaded machine (the tiny model generates hundreds of tokens a second).
    model = make_hf_model("llama", vocab_size=len(tok), max_position_embeddings=CONTEXT)
    model.save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    int4 = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 64}, "target": {"name": "triton"},
                                     "passes": [{"name": "awq", "group_size": 32}]})
    out = {"tiny": compile_model(root / "ckpt", PipelineConfig(), root / "artifact").path,
           "tiny-int4": compile_model(root / "ckpt", int4, root / "artifact-int4").path}
    modules = json.loads((out["tiny-int4"] / "manifest.json").read_text())["modules"]
    assert modules and all(m["format"] == "int4" for m in modules.values())
    return out


@pytest.fixture(scope="module")
def server(artifacts):
    """``qcompile serve`` in a subprocess on free 127.0.0.1 ports; stopped with SIGTERM, which must exit cleanly."""
    import backends  # noqa: F401  (registers the triton target)
    from backends.triton.runtime import free_port, prepare_runtime
    from compiler.deploy.lowering import lower

    prepare_runtime()
    root = artifacts[MODEL].parent
    for name, artifact in artifacts.items():
        lower(artifact, "triton", root / "repo", {"name": name})
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    log = root / "serve.log"
    project = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{project}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", "from qcompile.cli import main; main()", "serve", str(root / "repo"),
           "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
           "--log-file", str(log)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not _ready(ports["http"]):
        assert proc.poll() is None, f"qcompile serve exited early: {proc.stdout.read()}\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "server not ready in 240 s"
        time.sleep(0.5)
    yield {"http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}", "log": log}
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "tritonserver stopped (exit code 0)" in output, output
    text = log.read_text()
    assert all(f"successfully unloaded '{name}'" in text for name in MODELS)
    # Continuous batching: concurrent requests ran in the same engine steps.
    peaks = [int(n) for n in re.findall(r"peak running sequences (\d+)", text)]
    assert peaks and max(peaks) >= 2, "the engine never ran two sequences at once"


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def all_expected(artifacts) -> dict[str, list[list[int]]]:
    """Per model, the in-process engine's greedy tokens for every prompt (the reference)."""
    from serving import Engine

    out = {}
    for name, artifact in artifacts.items():
        engine = Engine.from_artifact(artifact)
        out[name] = [list(engine.generate(prompt=p, max_tokens=n, ignore_eos=True).token_ids) for p, n in zip(PROMPTS, MAX_TOKENS)]
    return out


@pytest.fixture(scope="module")
def expected(all_expected):
    return all_expected[MODEL]


async def _collect(adapter, prompt, max_tokens):
    from serving.types import SamplingParams

    return [e async for e in adapter.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


async def _concurrent(adapter):
    try:
        return await asyncio.gather(*[_collect(adapter, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
    finally:
        await adapter.close()


def _check_streams(streams, expected):
    for events, want, n in zip(streams, expected, MAX_TOKENS):
        assert [t for e in events for t in e.token_ids] == want
        assert len(events) == n, "one response per token"
        assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])


@pytest.mark.parametrize("model", MODELS)
def test_grpc_concurrent_streams_match_engine(server, all_expected, model):
    from serving.adapters.triton_grpc import TritonGrpcAdapter

    _check_streams(asyncio.run(_concurrent(TritonGrpcAdapter(server["grpc"], model))), all_expected[model])


@pytest.mark.parametrize("model", MODELS)
def test_http_generate_stream_matches_engine(server, all_expected, model):
    from serving.adapters.triton_http import TritonHttpAdapter

    _check_streams(asyncio.run(_concurrent(TritonHttpAdapter(server["http"], model))), all_expected[model])


def test_http_generate_single_response(server, expected):
    from serving.adapters.triton_http import TritonHttpAdapter

    (events,) = asyncio.run(_first(TritonHttpAdapter(server["http"], MODEL, stream=False)))
    assert len(events) == 1 and events[0].token_ids == expected[0] and events[0].finish_reason == "length"


async def _first(adapter):
    try:
        return [await _collect(adapter, PROMPTS[0], MAX_TOKENS[0])]
    finally:
        await adapter.close()


def _post(server, endpoint: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server['http']}/v2/models/{MODEL}/{endpoint}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


BAD_HTTP = {
    "missing text_input": {"max_tokens": 4},
    "text_input not a string": {"text_input": 5, "max_tokens": 4},
    "max_tokens not an int": {"text_input": "x", "max_tokens": "four"},
    "max_tokens beyond the limit": {"text_input": "x", "max_tokens": 100_000},
    "max_tokens zero": {"text_input": "x", "max_tokens": 0},
    "prompt longer than the model": {"text_input": TOO_LONG, "max_tokens": 4},
    "token id outside the vocabulary": {"input_ids": [1, 99_999], "max_tokens": 4},
    "both text and ids": {"text_input": "x", "input_ids": [1, 2], "max_tokens": 4},
    "temperature negative": {"text_input": "x", "max_tokens": 4, "temperature": -1.0},
}


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_bad_http_requests_get_errors_and_server_keeps_serving(server, expected, endpoint):
    for why, body in BAD_HTTP.items():
        status, text = _post(server, endpoint, json.dumps({**body, "stream": endpoint == "generate_stream"}).encode())
        assert status >= 400 or '"error"' in text, f"{why}: {status} {text}"
        assert "error" in text, why
    status, text = _post(server, endpoint, b'{"text_input": "x", "max_tokens": ')  # malformed body
    assert status >= 400 and "error" in text
    status, text = _post(server, "generate", json.dumps({"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS[0],
                                                         "ignore_eos": True, "stream": False}).encode())
    assert status == 200 and json.loads(text)["token_ids"] == expected[0]


def test_bad_grpc_requests_get_errors_and_server_keeps_serving(server, expected):
    from tritonclient.grpc import InferInput

    from serving.adapters.triton_common import TritonRequestError
    from serving.adapters.triton_grpc import TritonGrpcAdapter, _inputs

    def tensor(name, array, datatype):
        t = InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    cases = {
        "missing text_input": [tensor("max_tokens", np.array([4], np.int32), "INT32")],
        "max_tokens as FP32": _inputs({"text_input": "x"}) + [tensor("max_tokens", np.array([4.0], np.float32), "FP32")],
        "unknown input": _inputs({"text_input": "x"}) + [tensor("bogus", np.array([1], np.int32), "INT32")],
        "max_tokens beyond the limit": _inputs({"text_input": "x", "max_tokens": 100_000}),
        "two max_tokens values": _inputs({"text_input": "x"}) + [tensor("max_tokens", np.array([4, 5], np.int32), "INT32")],
    }

    async def run():
        adapter = TritonGrpcAdapter(server["grpc"], MODEL)
        try:
            for why, inputs in cases.items():
                async def one():
                    yield {"model_name": MODEL, "inputs": inputs}
                results = [(r, e) async for r, e in adapter.client.stream_infer(inputs_iterator=one(), stream_timeout=60)
                           if e is not None or r is not None][:1]
                assert results and results[0][1] is not None, why
            with pytest.raises(TritonRequestError, match="exceeds"):
                await _collect(adapter, TOO_LONG, 4)
            return await _collect(adapter, PROMPTS[1], MAX_TOKENS[1])
        finally:
            await adapter.close()

    events = asyncio.run(run())
    assert [t for e in events for t in e.token_ids] == expected[1]


def test_cancelled_stream_leaves_server_serving(server, expected):
    """A client that drops a long stream after two tokens: the others still get complete, correct streams."""
    from serving.adapters.triton_grpc import TritonGrpcAdapter
    from serving.types import SamplingParams

    async def run():
        adapter = TritonGrpcAdapter(server["grpc"], MODEL)
        try:
            stream = adapter.generate(PROMPTS[2], SamplingParams(max_tokens=CONTEXT - 64, ignore_eos=True))  # still running when the client leaves
            got = [await stream.__anext__(), await stream.__anext__()]
            await stream.aclose()  # cancels the gRPC call
            assert all(e.finish_reason is None for e in got)
            return await asyncio.gather(*[_collect(adapter, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
        finally:
            await adapter.close()

    _check_streams(asyncio.run(run()), expected)
    deadline = time.monotonic() + 30  # the model notices at the cancelled request's next token
    while "cancelled by the client; aborting it in the engine" not in server["log"].read_text():
        assert time.monotonic() < deadline, "the model never saw the cancellation"
        time.sleep(0.5)
