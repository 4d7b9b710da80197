"""Triton over gRPC bidirectional streaming (tritonclient's asyncio client)."""
from __future__ import annotations

import itertools
from typing import AsyncIterator

import numpy as np

from serving.adapters.triton_common import TritonRequestError, event_from_fields, request_fields
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
        from tritonclient.grpc.aio import InferenceServerClient

        self.url, self.model = url, model
        self.client = InferenceServerClient(url)
        self._ids = itertools.count()

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        request = {"model_name": self.model, "inputs": _inputs(request_fields(prompt, params, stream=True)),
                   "request_id": str(next(self._ids))}

        async def one_request():
            yield request

        responses = self.client.stream_infer(inputs_iterator=one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise TritonRequestError(error.message())
                event = event_from_fields(result.as_numpy("text_output").tolist(), result.as_numpy("token_ids").tolist(),
                                          result.as_numpy("finish_reason").tolist())
                yield event
                if event.finish_reason is not None:
                    return
            raise TritonRequestError("the server closed the stream before the final response")
        finally:
            responses.cancel()  # a client that stops early cancels the request on the server

    async def close(self) -> None:
        await self.client.close()
