"""Sharded safetensors weights, written tensor by tensor with a bounded footprint.

An artifact's weights are ``model.safetensors``, or, above ``SHARD_BYTES``, numbered shards
``model-00001-of-00003.safetensors`` … with ``model.safetensors.index.json`` (its
``weight_map`` names each tensor's shard), as Hugging Face checkpoints are.

``ShardWriter`` takes tensors one at a time: each is hashed on arrival and either kept (an
in-memory compile, whose tensors are alive anyway) or appended to a spool file beside the
shards (a streamed compile, which frees each block once it is written). ``write`` lays the
tensors out in the order it is given, so an in-memory and a streamed compile of one model write
the same bytes. The header comes last because it holds the manifest's checksum, which needs
every tensor's.

safetensors layout (what ``safe_open`` reads): an 8-byte little-endian header length, the JSON
header (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
padded with spaces to a multiple of 8 bytes), then the tensors' bytes back to back.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 2**30  # as transformers' save_pretrained: shards of at most 5 GiB
_SPOOL = ".spool"
_COPY_CHUNK = 64 * 2**20

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as stored (contiguous, on the CPU)."""
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


@dataclass
class _Entry:
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    sha256: str
    tensor: torch.Tensor | None  # kept in memory, or None: at ``offset`` in the spool
    offset: int = 0


def shard_names(n: int) -> list[str]:
    return [WEIGHTS] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


class ShardWriter:
    """Collects tensors (``add``), then writes the weights files into ``folder`` (``write``)."""

    def __init__(self, folder: Path, spool: bool):
        self.folder = Path(folder)
        self.entries: dict[str, _Entry] = {}
        self._spool = open(self.folder / _SPOOL, "w+b") if spool else None
        self._spooled = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors code")
        if name in self.entries:
            raise ValueError(f"tensor {name} added twice")
        data = tensor_bytes(t)
        entry = _Entry(t.dtype, list(t.shape), data.nbytes, hashlib.sha256(data).hexdigest(), None if self._spool else t)
        if self._spool is not None:
            entry.offset = self._spooled
            self._spool.write(data)
            self._spooled += data.nbytes
        self.entries[name] = entry

    def write(self, order: list[str], metadata: dict[str, str]) -> list[str]:
        """Write the tensors named in ``order`` (each exactly once) into shards of at most
        ``SHARD_BYTES`` (a larger tensor gets a shard of its own), each shard's header holding
        ``metadata``; with more than one shard, the index too. Returns the shards' file names."""
        if sorted(order) != sorted(self.entries):
            raise ValueError("write: the order must name every added tensor once")
        groups: list[list[str]] = [[]]
        size = 0
        for name in order:
            n = self.entries[name].nbytes
            if groups[-1] and size + n > SHARD_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += n
        names = shard_names(len(groups))
        if self._spool is not None:
            self._spool.flush()  # the spool is read back with pread, below Python's buffer
        for file, group in zip(names, groups):
            self._write_shard(self.folder / file, group, metadata)
        if len(names) > 1:
            weight_map = {t: file for file, group in zip(names, groups) for t in group}
            total = sum(e.nbytes for e in self.entries.values())
            index = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=1))
        self.close()
        return names

    def _write_shard(self, path: Path, names: list[str], metadata: dict[str, str]) -> None:
        header: dict = {"__metadata__": metadata}
        offset = 0
        for name in names:
            e = self.entries[name]
            header[name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": e.shape, "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name in names:
                self._copy(self.entries[name], f)

    def _copy(self, e: _Entry, f) -> None:
        if e.tensor is not None:
            f.write(tensor_bytes(e.tensor))
            return
        done = 0
        while done < e.nbytes:
            chunk = os.pread(self._spool.fileno(), min(_COPY_CHUNK, e.nbytes - done), e.offset + done)
            if not chunk:
                raise OSError(f"spool file {self.folder / _SPOOL} ended at {e.offset + done} bytes, short of a tensor")
            f.write(chunk)
            done += len(chunk)

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            (self.folder / _SPOOL).unlink(missing_ok=True)
            self._spool = None


def weight_files(folder: Path) -> list[Path]:
    """The weights files of an artifact directory: its shards (by the index), or ``model.safetensors``."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in dict.fromkeys(weight_map.values())]
    return [folder / WEIGHTS]
