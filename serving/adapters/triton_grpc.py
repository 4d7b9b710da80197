"""Triton over gRPC bidirectional streaming (tritonclient's asyncio client)."""
from __future__ import annotations

import itertools
from typing import AsyncIterator

import numpy as np

from serving.adapters.triton_common import (
    TritonRequestError,
    event_from_fields,
    request_fields,
)
from serving.types import SamplingParams, StreamEvent

# generate-extension field -> (Triton datatype, numpy dtype)
_TYPES = {"text_input": ("BYTES", np.object_), "input_ids": ("INT32", np.int32), "max_tokens": ("INT32", np.int32),
          "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32), "top_p": ("FP32", np.float32),
          "seed": ("INT64", np.int64), "stop": ("BYTES", np.object_), "ignore_eos": ("BOOL", np.bool_),
          "stream": ("BOOL", np.bool_)}


def _inputs(fields: dict):
    from tritonclient.grpc import InferInput

    inputs = []
    for name, value in fields.items():
        datatype, dtype = _TYPES[name]
        values = value if isinstance(value, list) else [value]
        if dtype is np.object_:
            values = [v.encode() for v in values]
        array = np.array(values, dtype=dtype)
        tensor = InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class TritonGrpcAdapter:
    """``ServingAdapter`` for a model served by Triton: one gRPC stream per request."""

    name = "triton-grpc"

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self._client = None
        self._ids = itertools.count()

    @property
    def client(self):
        """The asyncio gRPC client, made on first use (it binds to the running event loop)."""
        if self._client is None:
            from tritonclient.grpc.aio import InferenceServerClient

            self._client = InferenceServerClient(self.url)
        return self._client

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        request = {"model_name": self.model, "inputs": _inputs(request_fields(prompt, params, stream=True)),
                   "request_id": str(next(self._ids))}

        async def one_request():
            yield request

        responses = self.client.stream_infer(inputs_iterator=one_request())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True  # the error response is the request's last
                    raise TritonRequestError(error.message())
                event = event_from_fields(result.as_numpy("text_output").tolist(), result.as_numpy("token_ids").tolist(),
                                          result.as_numpy("finish_reason").tolist())
                finished = event.finish_reason is not None
                yield event
                if finished:
                    break
            if not finished:
                raise TritonRequestError("the server closed the stream before the final response")
            async for _ in responses:  # the server closes the stream after the final response
                pass
        finally:
            if not finished:
                responses.cancel()  # a client that stops early cancels the request on the server

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
