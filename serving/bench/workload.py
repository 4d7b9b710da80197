"""Workloads: the requests a benchmark sends, built before any load is applied.

Three kinds, all deterministic for a seed:
  - synthetic: prompt and output lengths drawn from a distribution (``fixed``, ``uniform``,
    ``normal``); each prompt is a window of real corpus tokens (``calib``), so the model reads
    real text, and is sent as token ids so its length is exact (decode/re-encode would drift);
  - a ``.jsonl`` prompts file: one object per line with ``prompt`` (text) and optionally
    ``output_len``;
  - shared prefix: every synthetic prompt starts with the same ``shared_prefix`` tokens
    (exercises prefix caching), followed by its own suffix.
Output length is enforced with ``ignore_eos`` so runs of different models compare.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib import load_corpus_text
from serving.bench.errors import BenchError
from serving.types import SamplingParams


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed:N`` (or just ``N``), ``uniform:LO:HI``, ``normal:MEAN:STD``."""

    kind: str
    a: int
    b: int = 0

    @classmethod
    def parse(cls, spec: str | int, what: str) -> "LengthDist":
        text = str(spec).strip()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", int(parts[0]))
            elif parts[0] == "fixed" and len(parts) == 2:
                dist = cls("fixed", int(parts[1]))
            elif parts[0] in ("uniform", "normal") and len(parts) == 3:
                dist = cls(parts[0], int(parts[1]), int(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise BenchError(f"{what} {text!r} is not a length; use N, fixed:N, uniform:LO:HI or normal:MEAN:STD") from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or (dist.kind == "normal" and dist.b < 0):
            raise BenchError(f"{what} {text!r} is out of range; lengths are >= 1 and uniform needs LO <= HI")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.randint(self.a, self.b)
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        return f"{self.kind}:{self.a}" + (f":{self.b}" if self.kind != "fixed" else "")


@dataclass(frozen=True)
class BenchRequest:
    """One request: the prompt (token ids or text), its measured input length, and its sampling params."""

    prompt: list[int] | str
    input_tokens: int
    params: SamplingParams


@dataclass(frozen=True)
class WorkloadConfig:
    """How to build the requests; ``describe()`` goes into the result's settings."""

    prompt_len: LengthDist = LengthDist("fixed", 128)
    output_len: LengthDist = LengthDist("fixed", 64)
    corpus: str = "pydoc"
    prompts_file: Path | None = None
    shared_prefix: int = 0
    seed: int = 0

    def describe(self) -> dict[str, Any]:
        kind = "prompts_file" if self.prompts_file else ("shared_prefix" if self.shared_prefix else "synthetic")
        return {"kind": kind, "prompt_len": str(self.prompt_len), "output_len": str(self.output_len),
                "corpus": self.corpus, "prompts_file": str(self.prompts_file) if self.prompts_file else None,
                "shared_prefix": self.shared_prefix, "seed": self.seed}


def _params(output_len: int) -> SamplingParams:
    # Greedy with ignore_eos: every request produces exactly output_len tokens on a conforming target.
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def corpus_token_ids(tokenizer, corpus: str) -> list[int]:
    """The corpus tokenized once (no special tokens): the pool prompts are cut from."""
    return list(tokenizer(load_corpus_text(corpus), add_special_tokens=False)["input_ids"])


def synthetic_requests(config: WorkloadConfig, tokens: list[int], count: int) -> list[BenchRequest]:
    """``count`` requests whose prompts are windows of ``tokens`` (real corpus text)."""
    rng = random.Random(config.seed)
    prefix = tokens[: config.shared_prefix]
    pool = tokens[config.shared_prefix:]
    requests = []
    for _ in range(count):
        length = config.prompt_len.sample(rng)
        if length > len(pool):
            raise BenchError(f"prompt length {length} exceeds the corpus ({len(pool)} tokens); use a shorter --prompt-len or a larger corpus")
        start = rng.randint(0, len(pool) - length)
        ids = prefix + pool[start:start + length]
        requests.append(BenchRequest(ids, len(ids), _params(config.output_len.sample(rng))))
    return requests


def file_requests(config: WorkloadConfig, tokenizer, count: int) -> list[BenchRequest]:
    """Requests from a ``.jsonl`` file, cycled to ``count``; ``output_len`` per line or from the distribution."""
    path = config.prompts_file
    if path is None or not path.is_file():
        raise BenchError(f"prompts file {path} not found; give a .jsonl file with one {{\"prompt\": ...}} object per line")
    rng = random.Random(config.seed)
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, out_len = str(row["prompt"]), row.get("output_len")
        except (json.JSONDecodeError, TypeError, KeyError):
            raise BenchError(f"{path}:{line_no}: expected a JSON object with a \"prompt\" field") from None
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if tokenizer is not None else None
        rows.append((ids if ids is not None else prompt, len(ids) if ids is not None else 0, out_len))
    if not rows:
        raise BenchError(f"prompts file {path} holds no prompts")
    requests = []
    for i in range(count):
        prompt, n_in, out_len = rows[i % len(rows)]
        requests.append(BenchRequest(prompt, n_in, _params(int(out_len) if out_len else config.output_len.sample(rng))))
    return requests


def build_requests(config: WorkloadConfig, tokenizer, count: int) -> list[BenchRequest]:
    """The ``count`` requests of ``config``; synthetic workloads need the target's tokenizer."""
    if config.prompts_file is not None:
        return file_requests(config, tokenizer, count)
    if tokenizer is None:
        raise BenchError("synthetic workloads need the model's tokenizer; pass --tokenizer ARTIFACT_OR_HF_DIR")
    return synthetic_requests(config, corpus_token_ids(tokenizer, config.corpus), count)
