"""``ServingAdapter`` over Ascend offline models (.om) built by ``qcompile lower --target ascend``.

The bundle holds ``om/prefill*.om`` (input_ids [1, gear], one of the ATC ``--dynamic_dims``
gears) and ``om/decode*.om`` (one token, the KV cache as inputs/outputs). A prompt is padded
on the right to the smallest gear that holds it: causal masking keeps the real tokens blind to
the padding, the logits are read at the last real position, and the padding's cache slots are
overwritten by decode before any query can see them (decode masks keys past its position).

Runs through ``ais_bench``'s ``InferSession`` (the CANN inference tool). Without it (no CANN
here) constructing the adapter raises ``BackendUnavailable`` with what to install; callers such
as the benchmark suite skip the target on that error. pyACL directly is not implemented.
"""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import AsyncIterator, Callable, Protocol

import numpy as np

from backends.onnx.bundle import OnnxBundleInfo
from compiler.errors import ArtifactError, ConfigError, QCompileError
from compiler.io.types import load_tokenizer
from serving.adapters._stream import admit, encode, stream_tokens
from serving.types import SamplingParams, StreamEvent


class BackendUnavailable(QCompileError):
    """The runtime this adapter needs is not installed on this machine."""


class OmSession(Protocol):
    def infer(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        """Run the model on ``feeds`` (in the model's input order); outputs in its output order."""
        ...


SessionFactory = Callable[[Path, bool], OmSession]  # (om path, has dynamic dims) -> session


def ais_bench_factory(device_id: int = 0) -> SessionFactory:
    """Sessions through ais_bench's InferSession; BackendUnavailable when it is not installed."""
    if importlib.util.find_spec("ais_bench") is None:
        raise BackendUnavailable("the Ascend adapter needs ais_bench (and CANN) to run .om files; none here, so the "
                                 "ascend target is skipped: on an Ascend host install CANN and ais_bench")
    from ais_bench.infer.interface import InferSession

    class _Session:
        def __init__(self, path: Path, dynamic: bool):
            self.session, self.mode = InferSession(device_id, str(path)), "dymdims" if dynamic else "static"

        def infer(self, feeds):
            return self.session.infer(feeds, mode=self.mode)

    return _Session


def npu_device(index: int = 0):
    """The torch ``npu`` device; imports torch_npu only now (without CANN it breaks ``import torch``)."""
    if importlib.util.find_spec("torch_npu") is None:
        raise BackendUnavailable("device 'npu' needs torch_npu built for this host's CANN; install it on an Ascend host")
    import torch
    import torch_npu  # noqa: F401  (registers the npu device)

    return torch.device(f"npu:{index}")


class OmModel:
    """The two .om sessions as a TokenModel (batch 1), holding the KV cache between calls."""

    def __init__(self, bundle_dir: Path, info: OnnxBundleInfo, factory: SessionFactory):
        self.info, self.max_len = info, info.max_len
        self.buckets = sorted(info.extras["buckets"])
        self.prefill_session = factory(_om_file(bundle_dir, "prefill"), True)
        self.decode_session = factory(_om_file(bundle_dir, "decode"), False)
        self.cache: list[np.ndarray] = []
        self.length = 0

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ConfigError(f"prompt of {n} tokens is longer than the largest prefill gear {self.buckets[-1]}; "
                          "lower again with a larger gear in --buckets")

    def prefill(self, prompt_ids: list[int]) -> np.ndarray:
        n = len(prompt_ids)
        padded = np.zeros((1, self.bucket(n)), np.int64)
        padded[0, :n] = prompt_ids
        logits, *self.cache = self.prefill_session.infer([padded])
        self.length = n
        return np.asarray(logits[0, n - 1], np.float32)

    def decode(self, token_id: int) -> np.ndarray:
        feeds = [np.array([[token_id]], np.int64), np.array([self.length], np.int64), *self.cache]
        logits, *self.cache = self.decode_session.infer(feeds)
        self.length += 1
        return np.asarray(logits[0, -1], np.float32)


def _om_file(bundle_dir: Path, graph: str) -> Path:
    found = sorted((bundle_dir / "om").glob(f"{graph}*.om"))
    if not found:
        raise ArtifactError(f"{bundle_dir}: no om/{graph}.om; build it on a CANN host with 'bash {bundle_dir / 'build_om.sh'}'")
    return found[0]


class AscendAdapter:
    """Streams tokens from the .om pair; same sampling options as the ONNX Runtime adapter."""

    name = "ascend"

    def __init__(self, bundle_dir: str | Path, device_id: int = 0, session_factory: SessionFactory | None = None):
        bundle_dir = Path(bundle_dir)
        info = OnnxBundleInfo.read(bundle_dir)
        if info.target != "ascend":
            raise ArtifactError(f"{bundle_dir}: a {info.target!r} bundle; lower with --target ascend for this adapter")
        self.model = OmModel(bundle_dir, info, session_factory or ais_bench_factory(device_id))
        self.tokenizer = load_tokenizer(bundle_dir) if info.tokenizer else None
        self._lock = asyncio.Lock()

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path) -> "AscendAdapter":
        """The adapter for a bundle from ``qcompile lower --target ascend`` on device 0 (the bench suite's entry)."""
        return cls(bundle_dir)

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        model = self.model
        request = admit(encode(prompt, self.tokenizer), params, self.tokenizer, model.info.eos_token_ids, model.max_len)
        async with self._lock:
            async for event in stream_tokens(model, request):
                yield event

    async def close(self) -> None:
        self.model = None
