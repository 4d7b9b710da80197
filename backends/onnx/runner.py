"""Run an ONNX bundle with ONNX Runtime, keeping the KV cache across decode steps.

The cache lives in one set of OrtValues bound with IO binding as both ``past_*`` and
``present_*`` of each decode step: the decode graph writes a step's new rows with ScatterElements,
whose ONNX Runtime kernel skips its copy of the data when the output is the input's buffer
(``src_base != dst_base`` in its CPU kernel), so a step writes its new rows in place rather than a
whole new cache (the outputs are bit for bit those of two swapped sets; the time saved is in the
benchmarks doc, "Engine decode step on the CPU").
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from backends.onnx.bundle import DECODE_FILE, PREFILL_FILE, OnnxBundleInfo
from compiler.errors import ConfigError

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class OnnxRunner:
    """Prefill then decode one batch of equal-length prompts; ``length`` is the tokens cached."""

    def __init__(self, bundle_dir: str | Path, threads: int | None = None):
        import onnxruntime as ort

        self.dir = Path(bundle_dir)
        self.info = OnnxBundleInfo.read(self.dir)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.log_severity_level = 3
        providers = ["CPUExecutionProvider"]
        self.prefill_session = ort.InferenceSession(str(self.dir / PREFILL_FILE), options, providers=providers)
        self.decode_session = ort.InferenceSession(str(self.dir / DECODE_FILE), options, providers=providers)
        self.length = 0
        self._cache: list = []  # past_key.0, past_value.0, past_key.1, ...

    def _new_cache(self, batch: int) -> list:
        import onnxruntime as ort

        info = self.info
        shape = (batch, info.n_kv_heads, info.max_len, info.head_dim)
        zeros = np.zeros(shape, NP_DTYPES[info.dtype])
        return [ort.OrtValue.ortvalue_from_numpy(zeros.copy()) for _ in range(2 * info.n_layers)]

    def _cache_names(self, prefix: str) -> list[str]:
        return [f"{prefix}_{w}.{i}" for i in range(self.info.n_layers) for w in ("key", "value")]

    def prefill(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits [B, T, V] for prompts [B, T]; the cache then holds them."""
        batch, seq = input_ids.shape
        self._check_room(seq, 0)
        self._cache = self._new_cache(batch)
        binding = self.prefill_session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        binding.bind_output("logits")  # first, so get_outputs()[0] is the logits
        for name, value in zip(self._cache_names("present"), self._cache):
            binding.bind_ortvalue_output(name, value)
        self.prefill_session.run_with_iobinding(binding)
        self.length = seq
        return binding.get_outputs()[0].numpy()

    def decode(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits [B, T, V] for the next tokens [B, T] (usually T = 1) at positions length.."""
        if not self._cache:
            raise ConfigError("decode() before prefill(): run the prompt through prefill first")
        seq = input_ids.shape[1]
        self._check_room(seq, self.length)
        binding = self.decode_session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        binding.bind_output("logits")  # first, so get_outputs()[0] is the logits
        binding.bind_cpu_input("past_len", np.array([self.length], np.int64))
        for past, present, value in zip(self._cache_names("past"), self._cache_names("present"), self._cache):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)  # in place: see the module docstring
        self.decode_session.run_with_iobinding(binding)
        self.length += seq
        return binding.get_outputs()[0].numpy()

    def _check_room(self, seq: int, start: int) -> None:
        if start + seq > self.info.max_len:
            raise ConfigError(f"{start + seq} tokens do not fit the bundle's cache (max_len={self.info.max_len}); "
                              "lower the artifact again with a larger --max-len")

    def generate(self, input_ids: np.ndarray, max_new_tokens: int, eos_token_ids: list[int] | None = None) -> np.ndarray:
        """Greedy decoding, the same contract as ``Transformer.generate``: prompt + new tokens [B, T + n]."""
        logits = self.prefill(input_ids)
        out = np.asarray(input_ids, np.int64)
        for step in range(max_new_tokens):
            next_ids = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            out = np.concatenate([out, next_ids], axis=1)
            if eos_token_ids and out.shape[0] == 1 and int(next_ids[0, 0]) in eos_token_ids:
                break
            if step + 1 < max_new_tokens:
                logits = self.decode(next_ids)
        return out
