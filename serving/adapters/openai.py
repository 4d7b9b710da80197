"""Any OpenAI-compatible server (vLLM, SGLang, TGI, Triton's OpenAI frontend, …): streamed ``/v1/completions``.

One request per ``generate``: ``POST /v1/completions`` with ``stream: true``; the server answers
with server-sent events, ``data: {"choices": [{"text", "finish_reason", …}]}`` per chunk and
``data: [DONE]`` at the end. Exact lengths and counts need three fields beyond OpenAI's own,
which vLLM takes (and servers that do not know them ignore):

    prompt            token ids (a list of ints) when the caller gives ids, else the text
    ignore_eos        keep generating past EOS, so a benchmark gets the output length it asked for
    return_token_ids  each chunk carries ``token_ids``, the ids it adds (vLLM >= 0.10)

llama.cpp's ``llama-server`` (its ``/v1/models`` entries are ``owned_by: llamacpp``) streams no
``token_ids``; there the request also asks ``logprobs: 1``, whose per-token entries carry each
token's ``id``. Each chunk becomes one ``StreamEvent`` with those ids. A server that sends text without ids
cannot be measured token by token: the adapter raises ``OpenAIRequestError`` saying so, rather
than guessing token counts from the text.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from serving.types import RequestError, SamplingParams, StreamEvent

FINISH = {"stop": "stop", "length": "length", "abort": "abort", "content_filter": "stop"}


class OpenAIRequestError(RequestError):
    """The server refused a request, or streamed something that is not an OpenAI completion."""


def request_body(model: str, prompt: str | list[int], params: SamplingParams, ids_by_logprobs: bool = False) -> dict:
    """The ``/v1/completions`` request for ``prompt`` with ``params`` (greedy when temperature is 0);
    ``ids_by_logprobs``: the token ids come with each token's logprob (llama.cpp's server)."""
    body = {"model": model, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "stream": True, "ignore_eos": params.ignore_eos, "return_token_ids": True}
    if ids_by_logprobs:
        body["logprobs"] = 1
    if params.top_k:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def parse_chunk(payload: dict) -> StreamEvent | None:
    """One SSE payload -> its event (None for a chunk without a choice, e.g. usage)."""
    if "error" in payload:
        error = payload["error"]
        raise OpenAIRequestError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
    choices = payload.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    text = choice.get("text") or ""
    ids = choice.get("token_ids")
    if ids is None and isinstance(choice.get("logprobs"), dict) and choice["logprobs"].get("content"):
        ids = [entry["id"] for entry in choice["logprobs"]["content"]]  # llama.cpp's server
    if ids is None and text:
        raise OpenAIRequestError("the server streams text without token ids (no 'token_ids' in its chunks); "
                                 "qcompile bench counts tokens by their ids: use a server that honours "
                                 "return_token_ids (vLLM >= 0.10)")
    reason = choice.get("finish_reason")
    return StreamEvent(list(ids or []), text, FINISH.get(reason, "stop") if reason else None)


class OpenAIAdapter:
    """``ServingAdapter`` over an OpenAI-compatible server at ``url`` (HOST:PORT) serving ``model``."""

    name = "openai"

    def __init__(self, url: str, model: str):
        self.base = f"http://{url}/v1"
        self.model = model
        self._session = None
        self._ids_by_logprobs: bool | None = None  # llama.cpp's server: asked once, at the first request

    @property
    def session(self):
        """The aiohttp session, made on first use (it binds to the running event loop)."""
        if self._session is None:
            import aiohttp

            # No total timeout: a long generation is not an error; connecting is bounded.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def _llama_cpp_server(self) -> bool:
        if self._ids_by_logprobs is None:
            async with self.session.get(f"{self.base}/models") as response:
                models = (await response.json()).get("data", []) if response.status == 200 else []
            self._ids_by_logprobs = any(m.get("owned_by") == "llamacpp" for m in models)
        return self._ids_by_logprobs

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        body = request_body(self.model, prompt, params, await self._llama_cpp_server())
        async with self.session.post(f"{self.base}/completions", json=body) as response:
            if response.status != 200:
                raise OpenAIRequestError(_error_text(await response.text(), response.status))
            async for line in response.content:  # SSE: "data: {...}" lines, blank separators
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = parse_chunk(json.loads(data))
                if event is not None:
                    yield event
                    if event.finish_reason is not None:
                        return
        raise OpenAIRequestError("the server ended the event stream before a choice with a finish_reason")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def served_models(url: str, timeout_s: float = 30.0) -> list[str]:
    """The model ids ``GET /v1/models`` lists at ``url`` (HOST:PORT)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{url}/v1/models", timeout=timeout_s) as response:
            return [m["id"] for m in json.load(response).get("data", [])]
    except urllib.error.HTTPError as e:
        raise OpenAIRequestError(f"GET http://{url}/v1/models: {_error_text(e.read().decode(errors='replace'), e.code)}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OpenAIRequestError(f"GET http://{url}/v1/models failed ({e}); is an OpenAI-compatible server running there?") from None


def _error_text(body: str, status: int) -> str:
    try:
        error = json.loads(body)["error"]
        return f"HTTP {status}: {error.get('message', error) if isinstance(error, dict) else error}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200]}"
