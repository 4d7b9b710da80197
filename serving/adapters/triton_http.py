"""Triton over HTTP: the generate extension's ``/generate_stream`` (SSE) and ``/generate`` endpoints."""
from __future__ import annotations

import json
from typing import AsyncIterator

from serving.adapters.triton_common import (
    TritonRequestError,
    event_from_fields,
    request_fields,
)
from serving.types import SamplingParams, StreamEvent


class TritonHttpAdapter:
    """``ServingAdapter`` over Triton's HTTP generate extension; ``stream=False`` uses ``/generate``
    (one response holding the whole text)."""

    name = "triton-http"

    def __init__(self, url: str, model: str, stream: bool = True):
        self.base = f"http://{url}/v2/models/{model}"
        self.stream = stream
        self._session = None

    @property
    def session(self):
        """The aiohttp session, made on first use (it binds to the running event loop)."""
        if self._session is None:
            import aiohttp

            # No total timeout: a long generation is not an error; connecting is bounded.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        body = request_fields(prompt, params, stream=self.stream)
        endpoint = "generate_stream" if self.stream else "generate"
        async with self.session.post(f"{self.base}/{endpoint}", json=body) as response:
            if response.status != 200:
                raise TritonRequestError(_error_text(await response.text(), response.status))
            if not self.stream:
                yield _event(json.loads(await response.text()))
                return
            async for line in response.content:  # SSE: "data: {...}" lines, blank separators
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = json.loads(line[5:])
                if "error" in payload:
                    raise TritonRequestError(payload["error"])
                event = _event(payload)
                yield event
                if event.finish_reason is not None:
                    return
        raise TritonRequestError("the server ended the event stream before the final response")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _event(payload: dict) -> StreamEvent:
    return event_from_fields(payload.get("text_output", ""), payload.get("token_ids", []), payload.get("finish_reason"))


def _error_text(body: str, status: int) -> str:
    try:  # /generate_stream sends its errors as an SSE event even with a 4xx status
        return json.loads(body.strip().removeprefix("data:"))["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200]}"
