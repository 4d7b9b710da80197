"""``qcompile eval ARTIFACT --reference REF --runtimes engine,onnx,vllm,gguf``: llama.cpp's
KL-divergence statistics of one artifact as each runtime it lowers to computes it, on the same
windows against the same reference, one row per runtime — so a drift that one lowering adds shows
as its own row.

    engine      qcompile's model forward in this process (``qcompile.load``); an artifact with INT4
                layers gives two rows, "engine w4a16" (the format's numerics) and "engine w4a8"
                (int8 activations, the engine's CPU default: ``serving.engine_setup.set_int4_compute``)
    onnx        the bundle of ``qcompile lower --target onnx`` (its defaults; max_len the window) in
                ONNX Runtime (``backends/onnx/runner.py``): the prefill graph's logits
    vllm        the checkpoint of ``--target vllm`` served by vLLM (``backends/vllm/runtime.py``):
                its prompt log-probabilities, the ``VLLM_TOP_K`` most likely tokens and the target
                at each position (``calib.kl_divergence.top_kld``: a lower bound of the KLD)
    gguf        the file of ``--target gguf`` in llama.cpp (llama-cpp-python on the build of
                ``scripts/setup_llama_cpp.sh``, its defaults: a float16 KV cache): its logits
    triton      not scored: the Triton model returns generated text only (``TRITON_REASON``)

Every runtime is opened (lowered, started) before the first window, then each batch of windows
goes to all of them with the reference computed once. A runtime this machine cannot run, or one
that fails on the way, gives a row with its one-line reason instead of numbers.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from calib.kl_divergence import TopLogProbs
from compiler.errors import ArtifactError, ConfigError, QCompileError
from compiler.io.types import LoadedModel
from compiler.options import suggest
from compiler.pipeline.evaluate import (Scorer, check_reference_options, reference_windows, score_windows,
                                        scored_logits)

RUNTIMES = ("engine", "onnx", "vllm", "gguf", "triton")
# Tokens per position vLLM returns (its --max-logprobs, set to this; its default is 20). On SmolLM2
# AWQ against its float model (2 windows) the top-k KLD was 74% of the full one at k = 20, 87% at 100,
# 94% at 500, 96% at 1000, 98% at 2000; a 512-token window's answer took 8 s at 100 or 500, 15 s at
# 1000, 25 s at 2000 (JSON of about 70 bytes a token, on a 2-core machine shared with other jobs).
VLLM_TOP_K = 1000
FULL_VOCABULARY = "full vocabulary"
TRITON_REASON = ("the Triton model (serving/triton_backend.py) returns generated text only, no logits or "
                 "log-probabilities; it runs qcompile's engine, whose numerics the engine rows give")


@dataclass
class RuntimeRow:
    """One row of the table: a runtime that scores windows, or why it does not."""

    name: str
    runs: str = ""  # what computes the distributions
    kl_over: str = FULL_VOCABULARY  # what the KLD sums over
    score: Scorer | None = None
    unavailable: str | None = None


@dataclass
class Candidate:
    """What every runtime opens from: the artifact, loaded, and a folder for what it lowers."""

    loaded: LoadedModel
    workdir: Path
    eval_len: int
    kept: bool  # the folder outlives the evaluation (--runtime-dir)

    @property
    def artifact(self) -> Path:
        if self.loaded.manifest is None:
            raise ArtifactError(f"{self.loaded.source.path} is not a qcompile artifact, and only an artifact is "
                                "lowered: compile it first (qcompile compile)")
        return Path(self.loaded.source.path)

    def lower(self, target: str, out: str, **options) -> Path:
        from compiler.deploy.lowering import lower

        return lower(self.artifact, target, self.workdir / out, options, force=True).path


def check_runtimes(names: list[str], reference: object = None, plot: object = None) -> list[str]:
    """``names`` in order without repeats, or a one-line error — an unknown runtime, no reference, a
    plot — before any work."""
    for name in names:
        if name not in RUNTIMES:
            raise ConfigError(f"--runtimes: unknown runtime {name!r}{suggest(name, RUNTIMES)}")
    if not names:
        raise ConfigError(f"--runtimes: name at least one of {', '.join(RUNTIMES)}")
    if reference is None:
        raise ConfigError("--runtimes compares each runtime with a reference: add --reference MODEL (or a reference file)")
    if plot is not None:
        raise ConfigError("--plot draws one candidate's histogram: drop --runtimes, or --plot")
    return list(dict.fromkeys(names))


def compare_runtimes(candidate: LoadedModel, runtimes: list[str], reference: LoadedModel | str | Path,
                     corpus: str = "pydoc", windows: int = 16, split: str = "evaluation",
                     save_reference: Path | None = None, eval_len: int = 512, runtime_dir: Path | None = None) -> dict:
    """The statistics of ``compare_to_reference`` for each of ``runtimes`` (``RUNTIMES``) running the
    artifact ``candidate``, on the same windows: ``{corpus, split, windows, reference, reference_model,
    "runtimes": [{"runtime", "runs", "kl_over", statistics...} or {"runtime", "runs", "unavailable": why}]}``.
    Lowered outputs (and vLLM's log) go to ``runtime_dir``, kept, else to a temporary folder."""
    runtimes = check_runtimes(runtimes, reference)
    check_reference_options(reference, save_reference, None)
    windowed = reference_windows(candidate, reference, corpus, windows, split, eval_len)
    with (_workdir(runtime_dir) as workdir,
          open_runtimes(runtimes, Candidate(candidate, workdir, eval_len, kept=runtime_dir is not None)) as rows):
        failures: dict[str, str] = {}
        stats = score_windows(windowed, {r.name: r.score for r in rows if r.score}, save_reference, failures)
    out = []
    for row in rows:
        why = row.unavailable or failures.get(row.name)
        described = {"runtime": row.name, "runs": row.runs}
        out.append({**described, "unavailable": why} if why else {**described, "kl_over": row.kl_over,
                                                                 **stats[row.name].result()})
    return {**windowed.describe(), "runtimes": out}


@contextlib.contextmanager
def _workdir(runtime_dir: Path | None) -> Iterator[Path]:
    if runtime_dir is not None:
        Path(runtime_dir).mkdir(parents=True, exist_ok=True)
        yield Path(runtime_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="qcompile-eval-") as tmp:
            yield Path(tmp)


@contextlib.contextmanager
def open_runtimes(names: list[str], candidate: Candidate) -> Iterator[list[RuntimeRow]]:
    """Each runtime's rows, opened (lowered, started) until the block ends; one that cannot open is a row with why."""
    with contextlib.ExitStack() as stack:
        rows = []
        for name in names:
            try:
                rows += OPENERS[name](candidate, stack)
            except QCompileError as e:
                rows.append(RuntimeRow(name, unavailable=str(e)))
        yield rows


def _engine(candidate: Candidate, stack: contextlib.ExitStack) -> list[RuntimeRow]:
    from compiler.formats.int4 import Int4Linear
    from serving.engine_setup import set_int4_compute

    loaded = candidate.loaded
    model = loaded.model
    if not any(isinstance(m, Int4Linear) for m in model.modules()):
        return [RuntimeRow("engine", "qcompile's model forward", score=lambda batch: scored_logits(loaded, batch))]
    device = next(model.parameters()).device
    stack.callback(set_int4_compute, model, "w4a16", device)  # as loaded

    def in_mode(compute: str) -> Scorer:
        def score(batch: torch.Tensor) -> torch.Tensor:
            set_int4_compute(model, compute, device)  # the rows share the model: each sets its mode
            return scored_logits(loaded, batch)
        return score

    rows = [RuntimeRow("engine w4a16", "qcompile's model forward, INT4 on float activations", score=in_mode("w4a16"))]
    try:
        info = set_int4_compute(model, "w4a8", device)
    except QCompileError as e:
        return rows + [RuntimeRow("engine w4a8", unavailable=str(e))]
    kept = f"; {len(info['w4a16'])} layers stay W4A16 ({next(iter(info['w4a16'].values()))})" if info["w4a16"] else ""
    return rows + [RuntimeRow("engine w4a8", f"qcompile's model forward, INT4 on int8 activations ({info['kernel']}){kept}",
                              score=in_mode("w4a8"))]


def _onnx(candidate: Candidate, stack: contextlib.ExitStack) -> list[RuntimeRow]:
    from backends.onnx.runner import OnnxRunner

    runner = OnnxRunner(candidate.lower("onnx", "onnx", max_len=candidate.eval_len))

    def score(batch: torch.Tensor) -> torch.Tensor:
        logits = runner.prefill(batch.numpy().astype(np.int64))[:, :-1]
        return torch.from_numpy(logits.reshape(-1, logits.shape[-1])).float()

    return [RuntimeRow("onnx", f"ONNX Runtime, the bundle's prefill graph{_exported_as(runner.info.layers)}", score=score)]


def _exported_as(layers: dict[str, str]) -> str:
    """How the bundle's quantized layers were exported, each way with its count ('' for a float model)."""
    counts = Counter(layers.values())
    return "".join(f"; {how} ×{n}" for how, n in counts.items())


def _vllm(candidate: Candidate, stack: contextlib.ExitStack) -> list[RuntimeRow]:
    from backends.triton.runtime import free_port
    from backends.vllm.evaluate import window_top_logprobs
    from backends.vllm.runtime import VllmHostError, VllmOptions, VllmServer, VllmServerError, vllm_python

    python = vllm_python()  # not installed: the reason, before lowering anything
    config = candidate.loaded.model.config
    length = candidate.eval_len + 1  # a window and the one token vLLM must generate
    if length > config.max_seq_len:
        raise ConfigError(f"vLLM serves this model up to {config.max_seq_len} tokens (its maximum positions), and a "
                          f"window and one generated token are {length}")
    checkpoint = candidate.lower("vllm", "vllm")
    top = min(VLLM_TOP_K, config.vocab_size)
    # --enforce-eager: no torch.compile warm-up (minutes on a small CPU), the same numerics
    opts = VllmOptions(checkpoint, port=free_port(), served_name="candidate", max_model_len=length,
                       extra_args=["--enforce-eager", "--max-logprobs", str(top)])
    try:
        server = stack.enter_context(VllmServer(opts, log_path=candidate.workdir / "vllm.log", python=python))
    except VllmHostError:
        raise  # refused before it started: no log
    except VllmServerError as e:
        raise VllmServerError(f"{e}{'' if candidate.kept else ' (pass --runtime-dir DIR to keep the log)'}") from None

    def score(batch: torch.Tensor) -> TopLogProbs:
        windows = [window_top_logprobs(server.url, server.model, window, top) for window in batch.tolist()]
        return TopLogProbs.concat(windows)

    kl_over = FULL_VOCABULARY if top >= config.vocab_size else f"top-{top} + target, the rest as one token (a lower bound)"
    return [RuntimeRow("vllm", f"vLLM's prompt log-probabilities ({top} per position)", kl_over, score)]


def _gguf(candidate: Candidate, stack: contextlib.ExitStack) -> list[RuntimeRow]:
    from backends.gguf.llama_cpp import VERSION, import_llama_cpp

    llama_cpp = import_llama_cpp()  # not built: the reason, before lowering anything
    path = candidate.lower("gguf", "model.gguf")
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=candidate.eval_len, n_batch=candidate.eval_len,
                              logits_all=True, verbose=False, n_threads=os.cpu_count())
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        raise ConfigError(f"llama.cpp could not load {path}: {e}") from None
    stack.callback(llm.close)

    def score(batch: torch.Tensor) -> torch.Tensor:
        rows = []
        for window in batch.tolist():
            llm.reset()
            llm.eval(window)
            rows.append(torch.from_numpy(np.array(llm.scores[:len(window) - 1], dtype=np.float32)))
        return torch.cat(rows)

    return [RuntimeRow("gguf", f"llama.cpp (llama-cpp-python {VERSION}, its default float16 KV cache)", score=score)]


def _triton(candidate: Candidate, stack: contextlib.ExitStack) -> list[RuntimeRow]:
    raise ConfigError(TRITON_REASON)


OPENERS: dict[str, Callable[[Candidate, contextlib.ExitStack], list[RuntimeRow]]] = {
    "engine": _engine, "onnx": _onnx, "vllm": _vllm, "gguf": _gguf, "triton": _triton}
