"""``qcompile generate`` and the in-process ``EngineAdapter`` on a tiny artifact with a tokenizer."""
from __future__ import annotations

import asyncio

import pytest

from serving.types import SamplingParams


@pytest.fixture
def tiny_artifact(tiny_checkpoint_with_tokenizer, tmp_path):
    import passes  # noqa: F401  (registers paged_kv)
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    path, _ = tiny_checkpoint_with_tokenizer()
    config = PipelineConfig.from_dict({"passes": [{"name": "paged_kv", "block_size": 8, "num_blocks": 32}]})
    return compile_model(path, config, tmp_path / "art").path


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    from qcompile.cli import main

    monkeypatch.setattr("sys.argv", ["qcompile", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_command_streams_and_reports(tiny_artifact, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", str(tiny_artifact), "def f(x):", "--max-tokens", "6",
                             "--ignore-eos")
    assert code == 0, err
    assert "6 tokens in" in err and "finish: length" in err


def test_generate_command_rejects_an_impossible_request(tiny_artifact, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", str(tiny_artifact), "hi", "--max-tokens", "5000")
    assert code == 2
    assert err.startswith("error: ") and "exceeds" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_generate_command_refuses_bad_sampling_parameters_in_one_line(tiny_artifact, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", str(tiny_artifact), "hi", "--top-p", "0")
    assert code == 2 and err.startswith("error: ") and "top_p must be in (0, 1], got 0.0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_engine_adapter_streams_text_and_token_prompts(tiny_artifact):
    from serving.adapters.engine import EngineAdapter

    adapter = EngineAdapter.from_artifact(tiny_artifact, "cpu")
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def collect(prompt):
        return [e async for e in adapter.generate(prompt, params)]

    async def main():
        got = await asyncio.gather(collect("def f(x):"), collect([5, 6, 7, 8]))
        await adapter.close()
        return got

    text_events, id_events = asyncio.run(main())
    for events in (text_events, id_events):
        assert sum(len(e.token_ids) for e in events) == 5 and events[-1].finish_reason == "length"
    assert adapter.name == "engine" and not adapter.engine.has_unfinished()
