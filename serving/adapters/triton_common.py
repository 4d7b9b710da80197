"""What the Triton adapters share: the request's generate-extension fields and response parsing.

The names are those ``qcompile lower --target triton`` writes into config.pbtxt (Triton's vLLM
backend convention): ``text_input`` or ``input_ids``, ``max_tokens``, sampling parameters,
``stream``; responses carry ``text_output``, ``token_ids`` and ``finish_reason``.
"""
from __future__ import annotations

from serving.types import RequestError, SamplingParams, StreamEvent


class TritonRequestError(RequestError):
    """The server answered a request with an error (its message is Triton's): a user error at the CLI."""


def request_fields(prompt: str | list[int], params: SamplingParams, stream: bool) -> dict:
    """The request as generate-extension fields (JSON for HTTP; typed tensors for gRPC)."""
    fields = {"input_ids": list(prompt)} if isinstance(prompt, list) else {"text_input": prompt}
    fields.update(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                  top_p=params.top_p, ignore_eos=params.ignore_eos, stream=stream)
    if params.seed is not None:
        fields["seed"] = params.seed
    if params.stop:
        fields["stop"] = list(params.stop)
    return fields


def event_from_fields(text, token_ids, finish_reason) -> StreamEvent:
    """One ``StreamEvent`` from a response's outputs (scalars or lists, bytes or str)."""
    if isinstance(text, (list, tuple)):
        text = "".join(t.decode() if isinstance(t, bytes) else t for t in text)
    if isinstance(text, bytes):
        text = text.decode()
    if isinstance(finish_reason, (list, tuple)):
        finish_reason = finish_reason[0] if finish_reason else ""
    if isinstance(finish_reason, bytes):
        finish_reason = finish_reason.decode()
    ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
    return StreamEvent(ids, text or "", finish_reason or None)
