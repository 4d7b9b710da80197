"""Triton Python-backend model: one qcompile engine serving every request of this instance.

``qcompile lower --target triton`` writes ``REPO/<name>/1/model.py`` as a two-line entry that
imports ``TritonPythonModel`` from here (``backends/triton/lower.py``), so the repository runs
the engine of the qcompile installed beside the server, and the backends layer never imports
the serving layer. This module is imported only inside tritonserver's Python backend. The model is
decoupled: ``execute`` only hands each request to the engine and returns ``None``; an asyncio
loop on a background thread drives the engine, whose continuous batching lets requests that
arrive while others decode join the running batch. Each new token goes back through the
request's response sender; the last response carries the FINAL flag. With ``stream`` false the
whole text goes in one final response, so Triton's plain ``/generate`` endpoint works too.

Errors (bad parameters, a prompt that does not fit, an engine failure) become Triton error
responses for that request only; a cancelled request stops its stream in the engine.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from serving.types import RequestError, SamplingParams

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name: str, cast, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestError(f"input '{name}' must hold one value, got {values.size}")
    value = values[0]
    return cast(value.decode() if isinstance(value, bytes) else value)


def _strings(request, name: str) -> tuple[str, ...]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return ()
    return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1))


def parse_request(request, max_tokens_limit: int) -> tuple[dict, SamplingParams, bool]:
    """One request's prompt (``generate_stream``'s ``prompt`` or ``prompt_token_ids``), its sampling
    parameters and its ``stream`` flag."""
    text = _scalar(request, "text_input", str, None)
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if (text is None) == (ids_tensor is None):
        raise RequestError("give exactly one of 'text_input' (a string) or 'input_ids' (INT32 token ids)")
    max_tokens = _scalar(request, "max_tokens", int, 16)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise RequestError(f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_scalar(request, "temperature", float, 0.0),
        top_k=_scalar(request, "top_k", int, 0),
        top_p=_scalar(request, "top_p", float, 1.0),
        seed=_scalar(request, "seed", int, None),
        stop=_strings(request, "stop"),
        ignore_eos=_scalar(request, "ignore_eos", bool, False),
    )
    if text is not None:
        prompt = {"prompt": text}
    else:
        prompt = {"prompt_token_ids": [int(i) for i in ids_tensor.as_numpy().reshape(-1)]}
    return prompt, params, _scalar(request, "stream", bool, True)


def _response(text: str, token_ids: list[int], finish_reason: str | None) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
        pb_utils.Tensor("token_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_)),
    ])


def _error(message: str, code=None) -> "pb_utils.InferenceResponse":
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


def _check_device(device: str, kernels: str) -> None:
    """Fail the model load (not the first request) when the lowered-for device is missing."""
    import torch

    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "npu": hasattr(torch, "npu") and torch.npu.is_available()}
    if not available.get(device, False):
        raise pb_utils.TritonModelException(f"this repository was lowered for {device} (kernels: {kernels}) but no {device} device is visible")


def _send(sender, response, final: bool = True) -> None:
    """Send one response; a client that went away makes send fail, which must not kill the stream task."""
    try:
        sender.send(response, flags=FINAL if final else 0)
    except Exception as e:  # noqa: BLE001
        pb_utils.Logger.log_warn(f"qcompile: could not send a response ({type(e).__name__}: {e})")


class TritonPythonModel:
    """Loads the artifact into the engine once (``initialize``) and streams every request through it."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        artifact = Path(params["artifact"])
        if not artifact.is_absolute():
            artifact = Path(args["model_repository"]) / args["model_version"] / artifact
        _check_device(params.get("device", "cpu"), params.get("kernels", ""))
        self.max_tokens_limit = int(params["max_tokens_limit"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="qcompile-engine", daemon=True)
        self.thread.start()
        self.engine = self._call(self._create(str(artifact), params.get("device", "cpu")))

    async def _create(self, artifact: str, device: str):
        # Created on the loop's thread: the engine is single-threaded and binds its step task to this loop.
        from serving.engine import Engine

        return Engine.from_artifact(artifact, device=device)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, params, stream = parse_request(request, self.max_tokens_limit)
            except (RequestError, ValueError, UnicodeDecodeError) as e:
                _send(sender, _error(str(e)))
                continue
            asyncio.run_coroutine_threadsafe(self._serve(request, sender, prompt, params, stream), self.loop)
        return None

    async def _serve(self, request, sender, prompt: dict, params: SamplingParams, stream: bool) -> None:
        texts, token_ids = [], []
        events = None
        try:
            events = self.engine.generate_stream(**prompt, params=params)
            async for event in events:
                if request.is_cancelled():
                    pb_utils.Logger.log_info(f"qcompile: request {request.request_id()!r} cancelled by the client; aborting it in the engine")
                    _send(sender, _error("request cancelled", pb_utils.TritonError.CANCELLED))
                    return
                if stream:
                    final = event.finish_reason is not None
                    _send(sender, _response(event.text, list(event.token_ids), event.finish_reason), final)
                    if final:
                        return
                else:
                    texts.append(event.text)
                    token_ids.extend(event.token_ids)
                    if event.finish_reason is not None:
                        _send(sender, _response("".join(texts), token_ids, event.finish_reason))
                        return
            _send(sender, _error("the engine ended the stream without a finish reason"))
        except Exception as e:  # noqa: BLE001 -- any failure of one request is that request's error response
            _send(sender, _error(f"{type(e).__name__}: {e}"))
        finally:
            if hasattr(events, "aclose"):
                await events.aclose()  # aborts the sequence in the engine if it is still running

    def finalize(self) -> None:
        self._call(self._abort_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        stats = self.engine.scheduler.stats
        pb_utils.Logger.log_info(f"qcompile: engine stopped; peak running sequences {stats.max_running}, "
                                 f"preemptions {stats.num_preemptions} (loop thread alive: {self.thread.is_alive()})")

    async def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
