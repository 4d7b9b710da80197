"""A checkpoint read one decoder block at a time (streamed compiles): Hugging Face safetensors
(``StreamedCheckpoint``) or a llama.cpp GGUF file (``StreamedGguf``); ``open_streamed`` picks.

Both read only the config and where the tensors are up front. ``shell()`` is the model with its
embeddings, final norm and lm_head loaded and every decoder block left on the meta device;
``block(i)`` materialises block ``i``. Each read copies the tensors it needs out of the file in
the compile's dtype and keeps no mapping of the file, so what stays resident is the tensors
handed out, not the pages of the checkpoint touched so far (a mapping kept open would count every
page read in the process's RSS): safetensors files are mapped and unmapped per read, a GGUF
file's tensors are read into memory of their own and dequantized one by one.

The tensors, their dtype conversion and the ``SourceInfo`` are the same as ``load_hf_dir``'s and
``load_gguf``'s, so a streamed compile records the same source and computes on the same numbers.
"""
from __future__ import annotations

import ctypes
import gc
from abc import ABC, abstractmethod
from collections import defaultdict
from pathlib import Path

import torch

from compiler.errors import CheckpointError
from compiler.io.checkpoint import gguf_source, hf_config, hf_source, weight_files
from compiler.io.load import Checkpoint
from compiler.io.types import SourceInfo, load_tokenizer
from compiler.model.config import ModelConfig
from compiler.model.transformer import DecoderLayer, Transformer, rope_inv_freq


class BlockReader(ABC):
    """What a streamed compile reads a checkpoint through. A subclass sets ``path``, ``dtype``,
    ``config``, ``source`` and ``tokenizer``, and says which tensors the file holds (``_holds``)
    and how a set of them is read (``_load``)."""

    path: Path
    dtype: torch.dtype
    config: ModelConfig
    source: SourceInfo
    tokenizer: object

    def shell(self) -> Transformer:
        """The model with embeddings, final norm and lm_head loaded; the decoder blocks on the meta device."""
        c = self.config
        with torch.device("meta"):
            model = Transformer(c)
        wanted = {k: p for k, p in model.state_dict().items()
                  if not k.startswith("layers.") and not (c.tie_embeddings and k == "lm_head.weight")}
        model.load_state_dict(self._read(wanted, ""), strict=False, assign=True)
        if c.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(c)
        return model.eval()

    def block(self, index: int) -> DecoderLayer:
        """Decoder block ``index`` with its weights, in the compile's dtype."""
        with torch.device("meta"):
            layer = DecoderLayer(self.config, index)
        layer.load_state_dict(self._read(layer.state_dict(), f"layers.{index}."), strict=True, assign=True)
        return layer.eval()

    def _read(self, wanted: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """The tensors ``prefix + name`` for each of ``wanted`` (meta tensors giving the shapes), copied out."""
        missing = sorted(prefix + k for k in wanted if not self._holds(prefix + k))
        if missing:
            raise CheckpointError(f"{self.path}: missing tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}; "
                                  "the checkpoint is incomplete")
        loaded = self._load([prefix + k for k in wanted])
        state = {k: loaded[prefix + k] for k in wanted}
        for k, t in state.items():
            if t.shape != wanted[k].shape:
                raise CheckpointError(f"{self.path}: tensor {prefix + k} has shape {tuple(t.shape)}, config implies "
                                      f"{tuple(wanted[k].shape)}")
        return state

    @abstractmethod
    def _holds(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name`` (our name)."""

    @abstractmethod
    def _load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors ``names`` (each held), copied out of the file in the compile's dtype."""


class StreamedCheckpoint(BlockReader):
    """A HF checkpoint directory with safetensors weights, read block by block."""

    def __init__(self, path: str | Path, dtype: torch.dtype, with_tokenizer: bool = True):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self.dtype = dtype
        self.config = hf_config(self.path)
        files, pickled = weight_files(self.path)
        if pickled:
            raise CheckpointError(f"{self.path}: a streamed compile reads safetensors, not pickles; convert the "
                                  "weights to safetensors or compile with --streaming off")
        self._where: dict[str, tuple[Path, str]] = {}  # our tensor name -> (file, name in the file)
        for f in files:
            try:
                with safe_open(f, framework="pt") as st:
                    for key in st.keys():
                        self._where[key.removeprefix("model.")] = (f, key)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: cannot read safetensors ({e}); the file is corrupt or truncated") from None
        self.source = hf_source(self.path, files)
        self.tokenizer = load_tokenizer(self.path) if with_tokenizer else None

    def _holds(self, name: str) -> bool:
        return name in self._where

    def _load(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self._where[name][0]].append(name)
        state = {}
        for f, in_file in by_file.items():
            try:
                with safe_open(f, framework="pt") as st:
                    for name in in_file:
                        state[name] = st.get_tensor(self._where[name][1]).to(self.dtype, copy=True)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: cannot read safetensors ({e}); the file is corrupt or truncated") from None
        return state


class StreamedGguf(BlockReader):
    """A llama.cpp GGUF file, read block by block: each tensor's bytes are read from the file and
    dequantized (q/k rows unpermuted, Gemma's norms restored, stacked experts split) as
    ``load_gguf`` does it."""

    def __init__(self, path: str | Path, dtype: torch.dtype, with_tokenizer: bool = True):
        from compiler.io.gguf import gguf_index

        self.path = Path(path)
        self.dtype = dtype
        self._index = gguf_index(self.path)
        self.config = self._index.config
        self.source = gguf_source(self.path)
        self.tokenizer = load_tokenizer(self.path.parent, gguf_file=self.path.name) if with_tokenizer else None

    def _holds(self, name: str) -> bool:
        return name in self._index.names

    def _load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Each stored tensor the names come from is read once (a MoE layer's stacked experts, for
        every expert of the block)."""
        from compiler.io.gguf import read_gguf_tensor

        wanted, state = set(names), {}
        with open(self.path, "rb") as f:
            for stored in dict.fromkeys(self._index.names[n] for n in names):
                got = read_gguf_tensor(f, self._index, stored, self.dtype, self.path)
                state.update((n, t) for n, t in got.items() if n in wanted)
        return state


def open_streamed(checkpoint: Checkpoint, dtype: torch.dtype) -> BlockReader:
    """The block reader of ``checkpoint``: a GGUF file, else a HF safetensors directory."""
    reader = StreamedGguf if checkpoint.kind == "gguf" else StreamedCheckpoint
    return reader(checkpoint.path, dtype)


def release_freed_memory() -> None:
    """Collect cyclic garbage (a converted block's hooks and closures can hold it) and hand the
    heap's free pages back to the kernel, so the process's footprint after each block is what is
    still alive, not the high-water mark of every block before it."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``). Without it, a pass
    that frees large temporaries between small long-lived statistics keeps their pages: a
    whole-model FP8 calibration held 1.5× its live tensors. Costs the next allocation its page faults."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: the allocator keeps its own policy
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
