"""Run an ONNX bundle with ONNX Runtime, keeping the KV cache across calls.

The cache (``KVCache``) is one numpy array per layer for K and one for V, [rows, Hkv, L, D], bound
by pointer with IO binding as both ``past_*`` and ``present_*`` of each call, so a graph writes its
new rows in place rather than a whole new cache: GroupQueryAttention writes into its past buffer
when the present one is the same memory, and the standard graph's ScatterElements skips its copy
of the data when the output is the input's buffer (``src_base != dst_base`` in its CPU kernel); the
outputs are bit for bit those of two swapped sets (the time saved is in the benchmarks doc, "Engine
decode step on the CPU"). ``np.zeros`` leaves untouched pages unmapped, so a cache of many rows
costs the memory of the positions written, not of max_len for every row.

Two ways to drive a bundle:

- the whole batch at once: ``prefill`` equal-length prompts [B, T], then ``decode`` [B, t] (any bundle);
- row by row (``prefill_row``, ``decode_rows``): a bundle whose attention takes a length per row
  (``OnnxBundleInfo.attention == "gqa"``), so a batch of rows of different lengths decodes in one
  call — the serving adapter's continuous batching (``serving/adapters/onnx_batch.py``).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from backends.onnx.bundle import DECODE_FILE, PREFILL_FILE, OnnxBundleInfo
from compiler.errors import ConfigError

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class KVCache:
    """K and V of every layer for ``rows`` sequences, [rows, Hkv, L, D]; a row's position p at index p."""

    def __init__(self, info: OnnxBundleInfo, rows: int):
        shape = (rows, info.n_kv_heads, info.max_len, info.head_dim)
        self.dtype = NP_DTYPES[info.dtype]
        self.rows = rows
        # past_key.0, past_value.0, past_key.1, ... as the graphs name them
        self.arrays = [np.zeros(shape, self.dtype) for _ in range(2 * info.n_layers)]
        self.names = [f"{w}.{i}" for i in range(info.n_layers) for w in ("key", "value")]

    def bind(self, binding, start: int, stop: int, as_input: bool) -> None:
        """Rows start..stop-1 as the present outputs and, when ``as_input``, the past inputs too (one buffer)."""
        if not 0 <= start < stop <= self.rows:
            raise ConfigError(f"cache rows {start}..{stop - 1} are outside the cache's {self.rows} rows")
        for name, array in zip(self.names, self.arrays):
            view = array[start:stop]  # a leading-axis slice of a C-contiguous array: contiguous, no copy
            if as_input:
                binding.bind_input(f"past_{name}", "cpu", 0, self.dtype, view.shape, view.ctypes.data)
            binding.bind_output(f"present_{name}", "cpu", 0, self.dtype, view.shape, view.ctypes.data)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` positions into row ``dst`` (the batcher closes gaps this way)."""
        for array in self.arrays:
            array[dst, :, :length] = array[src, :, :length]


class OnnxRunner:
    """The bundle's two sessions; ``length`` is the tokens cached by the whole-batch calls."""

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
        self.per_row = self.info.attention == "gqa"
        self.length = 0
        self._cache: KVCache | None = None
        # Per session, the last binding and the cache rows it binds (``_binding``).
        self._bindings: dict[int, tuple[KVCache, int, int, object]] = {}

    def new_cache(self, rows: int) -> KVCache:
        return KVCache(self.info, rows)

    # -- the whole batch ----------------------------------------------------------------------
    def prefill(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits [B, T, V] for prompts [B, T]; the cache then holds them."""
        batch, seq = input_ids.shape
        self._check_room(seq, 0)
        self._cache = self.new_cache(batch)
        logits = self._run(self.prefill_session, self._cache, 0, input_ids, None)
        self.length = seq
        return logits

    def decode(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits [B, T, V] for the next tokens [B, T] (usually T = 1) at positions length.."""
        if self._cache is None:
            raise ConfigError("decode() before prefill(): run the prompt through prefill first")
        batch, seq = input_ids.shape
        self._check_room(seq, self.length)
        logits = self._run(self.decode_session, self._cache, 0, input_ids, np.full(batch, self.length, np.int64))
        self.length += seq
        return logits

    # -- row by row ---------------------------------------------------------------------------
    def prefill_row(self, cache: KVCache, row: int, prompt_ids: np.ndarray) -> np.ndarray:
        """Logits [1, T, V] for one prompt [1, T], written into row ``row`` of ``cache`` from position 0."""
        self._check_room(prompt_ids.shape[1], 0)
        return self._run(self.prefill_session, cache, row, prompt_ids, None)

    def decode_rows(self, cache: KVCache, input_ids: np.ndarray, past_lens: np.ndarray) -> np.ndarray:
        """Logits [n, T, V] for tokens [n, T] appended to rows 0..n-1 of ``cache``, row r holding ``past_lens[r]``."""
        past_lens = np.asarray(past_lens, np.int64)
        self._check_room(input_ids.shape[1], int(past_lens.max()))
        return self._run(self.decode_session, cache, 0, input_ids, past_lens)

    # -- one call -----------------------------------------------------------------------------
    def _run(self, session, cache: KVCache, start: int, input_ids: np.ndarray, past_lens: np.ndarray | None) -> np.ndarray:
        """One graph call over cache rows start..start+B-1; ``past_lens`` None: a prefill from position 0."""
        binding = self._binding(session, cache, start, start + input_ids.shape[0])
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))  # copied: no buffer is kept
        # A new array each call, bound by pointer: an output ONNX Runtime allocated would be reused by the
        # binding's next call, overwriting the logits returned before.
        logits = np.empty((*input_ids.shape, self.info.vocab_size), NP_DTYPES[self.info.dtype])
        binding.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        if past_lens is not None and self.per_row:
            binding.bind_cpu_input("past_lens", np.ascontiguousarray(past_lens, np.int64))
        elif past_lens is not None:
            if (past_lens != past_lens[0]).any():
                raise ConfigError(f"{self.dir}: this bundle's graphs take one length for the whole batch (standard "
                                  "attention); lower it again without --no-fused-attention to decode rows of different lengths")
            binding.bind_cpu_input("past_len", past_lens[:1])
        session.run_with_iobinding(binding)
        return logits

    def _binding(self, session, cache: KVCache, start: int, stop: int):
        """An IO binding with the cache rows start..stop-1 bound, reused while the rows are
        the same: binding the 2 x layers cache tensors anew costs about a millisecond a call in Python."""
        held = self._bindings.get(id(session))
        if held is not None and held[0] is cache and held[1:3] == (start, stop):
            return held[3]
        binding = session.io_binding()
        # The prefill graph has past inputs only with GroupQueryAttention (they read nothing before position 0).
        as_input = session is self.decode_session or self.per_row
        cache.bind(binding, start, stop, as_input)
        self._bindings[id(session)] = (cache, start, stop, binding)  # holds the cache: its arrays outlive the binding
        return binding

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
