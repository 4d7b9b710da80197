"""The one token loop of every runtime: a request's state, fed one logits vector (or one sampled
token) at a time: sample (``serving.sampling``), detokenize and cut at stop strings
(``serving.output_text``), end at EOS or the token budget, and say so in the ``StreamEvent``.

The engine drives many of them through its scheduler (``serving/engine.py``); the adapters drive
theirs from their runtime's logits (``serving/adapters/_stream.py``: ONNX Runtime, Ascend, the
reference decoder), so the same logits give the same stream everywhere.
"""
from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field

import torch

from serving.output_text import OutputText
from serving.sampling import sample_token
from serving.types import RequestError, SamplingParams, StreamEvent  # noqa: F401  (RequestError: raised from here too)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute its KV
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass
class GenerationResult:
    """What ``Engine.generate`` returns: the whole output of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics


class Request:
    """Prompt and output tokens, progress (``num_computed_tokens`` have KV cached, for the engine),
    sampler and text state. ``seed``: the params' seed, else a random one; ``generator``: one to draw
    from instead (lm-eval's, which moves on from request to request)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: list[int],
                 tokenizer, device: torch.device = torch.device("cpu"), seed: int | None = None,
                 generator: torch.Generator | None = None):
        if seed is None:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.generator = generator or torch.Generator(device=device).manual_seed(seed)
        self.metrics = RequestMetrics()
        self.output = OutputText(tokenizer, params.stop)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def last_token(self) -> int:
        """The last token sampled: what the next decode step feeds."""
        return self.output_token_ids[-1]

    def sample(self, logits) -> int:
        """The next token from logits [V] (a tensor or a NumPy array), with this request's generator."""
        return sample_token(torch.as_tensor(logits).to(self.generator.device), self.params, self.generator)

    def next(self, logits) -> StreamEvent:
        """Sample the next token from ``logits`` and append it: the event to stream."""
        return self.append_token(self.sample(logits))

    def append_token(self, token_id: int) -> StreamEvent:
        """Add a sampled token; return the event to stream (its text delta, and why it ended if it did)."""
        if self.metrics.first_token_s is None:
            self.metrics.first_token_s = time.perf_counter()
        self.output_token_ids.append(token_id)
        reason = None
        if token_id in self.eos_token_ids and not self.params.ignore_eos:
            reason = "stop"
        elif len(self.output_token_ids) >= self.params.max_tokens:
            reason = "length"
        text, stopped = self.output.update(self.output_token_ids, final=reason is not None)
        if stopped:
            reason = "stop"
        if reason:
            self.finish(reason)
        return StreamEvent(token_ids=[token_id], text=text, finish_reason=reason)

    @property
    def text(self) -> str:
        """The output text so far, cut at a stop string."""
        return self.output.text

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_s = time.perf_counter()

    def result(self) -> GenerationResult:
        return GenerationResult(self.request_id, self.prompt_token_ids, list(self.output_token_ids), self.text,
                                self.finish_reason or "abort", self.metrics)
