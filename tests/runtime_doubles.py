"""TEST DOUBLES for the runtimes under the serving adapters, all driven by one scripted language
model: each generated position's logits pick the next token of a script (one-hot), whatever the
input. The adapters (and the engine core, the ONNX batcher, Triton's model) above them are the
real classes; only the model, the graph runner, the .om sessions and Triton's
``triton_python_backend_utils`` are doubles. Each counts the forwards it ran, so a test can see
that an aborted request stopped generating.
"""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import torch

FILLER = 4  # the token past the end of a script (a consumer that aborted may be one step behind)


class ScriptedLM:
    """TEST DOUBLE for a model: the logits [V] that predict position ``prompt_len + i`` are one-hot on ``script[i]``."""

    def __init__(self, script: list[int], prompt_len: int, vocab_size: int):
        self.script, self.prompt_len, self.vocab_size = script, prompt_len, vocab_size

    def logits(self, position: int) -> np.ndarray:
        i = position - self.prompt_len
        out = np.full(self.vocab_size, -1e9, dtype=np.float32)
        out[self.script[i] if i < len(self.script) else FILLER] = 0.0
        return out


class ScriptedModelRunner:
    """TEST DOUBLE for the engine's ``ModelRunner``: no forward; every request that samples this step
    gets the logits of its next position."""

    def __init__(self, lm: ScriptedLM):
        self.lm, self.forwards = lm, 0

    def execute(self, sched):
        self.forwards += 1
        sampled = [req for req, n in sched.scheduled if req.num_computed_tokens + n == req.num_tokens]
        return torch.tensor(np.stack([self.lm.logits(req.num_tokens) for req in sampled])), sampled


class _ScriptedCache:
    def move_row(self, src: int, dst: int, length: int) -> None:
        pass


class ScriptedOnnxRunner:
    """TEST DOUBLE for ``backends.onnx.runner.OnnxRunner``: the same calls, the scripted model's logits.
    ``per_row``: a GroupQueryAttention bundle (the adapter's continuous batcher) or a standard one."""

    def __init__(self, lm: ScriptedLM, eos_token_ids: list[int], per_row: bool, max_len: int = 64):
        self.lm, self.per_row, self.dir = lm, per_row, "scripted"
        self.info = types.SimpleNamespace(max_len=max_len, eos_token_ids=eos_token_ids, tokenizer=True)
        self.decoded_rows = 0  # rows of decode calls: what an aborted request must stop adding to
        self.length = 0

    def new_cache(self, rows: int) -> _ScriptedCache:
        return _ScriptedCache()

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        self.length = ids.shape[1]
        return self.lm.logits(self.length)[None, None]

    def decode(self, ids: np.ndarray) -> np.ndarray:
        self.decoded_rows += 1
        self.length += 1
        return self.lm.logits(self.length)[None, None]

    def prefill_row(self, cache, row: int, ids: np.ndarray) -> np.ndarray:
        return self.lm.logits(ids.shape[1])[None, None]

    def decode_rows(self, cache, ids: np.ndarray, past_lens: np.ndarray) -> np.ndarray:
        self.decoded_rows += len(ids)
        return np.stack([self.lm.logits(int(n) + 1) for n in past_lens])[:, None]


class ScriptedOmSession:
    """TEST DOUBLE for ais_bench's ``InferSession`` over the Ascend bundle's prefill or decode .om."""

    def __init__(self, lm: ScriptedLM, graph: str):
        self.lm, self.graph, self.calls = lm, graph, 0

    def infer(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        self.calls += 1
        if self.graph == "prefill":  # padded ids [1, gear]: logits at every position, read at the last real one
            logits = np.stack([self.lm.logits(p + 1) for p in range(feeds[0].shape[1])])[None]
        else:  # one token after ``length`` cached ones
            logits = self.lm.logits(int(feeds[1][0]) + 1)[None, None]
        return [logits, np.zeros(1, np.float32)]  # the logits and a stand-in for the KV cache


def write_ascend_bundle(directory, eos_token_ids: list[int], vocab_size: int, max_len: int = 64) -> None:
    """The files ``AscendAdapter`` opens: the bundle description and the two .om names."""
    from backends.onnx.bundle import OnnxBundleInfo

    (directory / "om").mkdir(parents=True)
    for graph in ("prefill", "decode"):
        (directory / "om" / f"{graph}.om").write_bytes(b"")
    OnnxBundleInfo("ascend", "float32", max_len, 1, 1, 8, vocab_size, eos_token_ids=eos_token_ids, tokenizer=True,
                   extras={"buckets": [8, 16]}).write(directory)


# -- Triton's Python backend --------------------------------------------------------------------------

class _Tensor:
    def __init__(self, name: str, value: np.ndarray):
        self.name, self.value = name, value

    def as_numpy(self) -> np.ndarray:
        return self.value


class _TritonError:
    CANCELLED = "CANCELLED"

    def __init__(self, message: str, code=None):
        self.message, self.code = message, code


class _InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name: t.value for t in output_tensors}
        self.error = error


def triton_backend_utils() -> types.ModuleType:
    """TEST DOUBLE for ``triton_python_backend_utils``, the module tritonserver's Python backend gives
    its models: what ``serving/triton_backend.py`` calls of it."""
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    module.Tensor, module.TritonError, module.InferenceResponse = _Tensor, _TritonError, _InferenceResponse
    module.TritonModelException = RuntimeError
    module.Logger = types.SimpleNamespace(log_info=lambda message: None, log_warn=lambda message: None)
    module.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return module


class TritonRequest:
    """TEST DOUBLE for a Triton request: its input tensors, its response sender (which keeps what was
    sent) and a client that cancels after ``cancel_after`` responses (None: never)."""

    def __init__(self, inputs: dict[str, np.ndarray], cancel_after: int | None = None):
        self.inputs = {name: _Tensor(name, value) for name, value in inputs.items()}
        self.cancel_after, self.responses, self.final = cancel_after, [], False

    def get_response_sender(self):
        return self

    def send(self, response, flags: int = 0) -> None:
        self.responses.append(response)
        self.final = self.final or bool(flags)

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def request_id(self) -> str:
        return "scripted"


def load_triton_backend(monkeypatch):
    """``serving.triton_backend`` imported over the ``triton_python_backend_utils`` double."""
    import importlib

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", triton_backend_utils())
    if "serving.triton_backend" in sys.modules:
        return importlib.reload(sys.modules["serving.triton_backend"])
    return importlib.import_module("serving.triton_backend")


def triton_model_args(max_tokens_limit: int = 64) -> dict:
    parameters = {"artifact": {"string_value": "/scripted"}, "device": {"string_value": "cpu"},
                  "max_tokens_limit": {"string_value": str(max_tokens_limit)}}
    return {"model_config": json.dumps({"parameters": parameters}), "model_repository": "/", "model_version": "1"}
