"""``qcompile serve FILE.gguf --engine llama.cpp``: the real llama-server on 127.0.0.1 streams the
tokens llama.cpp decodes in-process, token by token with their ids, through qcompile's OpenAI adapter."""
from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from gguf_helpers_llama import compile_awq, greedy_llama_cpp, save_checkpoint

import backends  # noqa: F401
from backends.gguf.llama_cpp import import_llama_cpp, missing_reason
from backends.gguf.server import LlamaServer, LlamaServerOptions
from compiler.deploy.lowering import lower
from compiler.errors import ConfigError
from serving.adapters.openai import OpenAIAdapter
from serving.types import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]
ROOT = Path(__file__).resolve().parents[3]
PROMPT = [5, 17, 42, 99, 7, 150, 33, 8]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-server")
    artifact = compile_awq(save_checkpoint(root, "llama"), root / "art", format="gguf:q4_0")
    return lower(artifact, "gguf", root / "m.gguf").path


def greedy_in_process(path: Path, tokens: int) -> list[int]:
    llm = import_llama_cpp().Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    return greedy_llama_cpp(llm, PROMPT, tokens)


async def _stream(adapter, params):
    try:
        return [e async for e in adapter.generate(PROMPT, params)]
    finally:
        await adapter.close()


def test_server_streams_llama_cpps_own_greedy_tokens(gguf_file, tmp_path):
    with LlamaServer(LlamaServerOptions(gguf_file, port=_free_port(), parallel=2), log_path=tmp_path / "log") as server:
        events = asyncio.run(_stream(OpenAIAdapter(server.url, server.model), SamplingParams(max_tokens=8, ignore_eos=True)))
    ids = [i for e in events for i in e.token_ids]
    assert events[-1].finish_reason == "length"
    # The first tokens are llama.cpp's own greedy ones. Further on, two things part them on this random
    # model: the server's batched decode sums in another order (a near-tie flips), and llama-server holds
    # back a token whose text is a partial UTF-8 character, streaming it with the next without its id.
    assert ids[:3] == greedy_in_process(gguf_file, 3) and len(ids) >= 5


def test_cli_serves_until_sigterm_and_refuses_a_non_gguf_in_one_line(gguf_file, tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qcompile", "serve", str(gguf_file), "--engine", "llama.cpp",
                             "--http-port", str(port), "--parallel", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # the command says when the model is served
            lines.append(line)
            if line.startswith("ready"):
                break
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        output = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert "ready: model" in output and "llama-server stopped" in output and proc.returncode == 0
    with pytest.raises(ConfigError, match="not a .gguf file"):
        LlamaServer(LlamaServerOptions(tmp_path))


def test_parallel_is_refused_by_the_other_engines(tmp_path):
    run = subprocess.run([sys.executable, "-m", "qcompile", "serve", str(tmp_path), "--engine", "triton", "--parallel", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--parallel sets llama.cpp's slots" in run.stderr and "Traceback" not in run.stderr
