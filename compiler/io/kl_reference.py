"""The reference file of ``qcompile eval --save-reference``: a reference model's next-token
distributions on the evaluation windows, computed once and compared with any number of candidates
(llama.cpp's ``--kl-divergence-base`` file, in safetensors).

Tensors, for W windows of T tokens and N = W·(T-1) scored positions (tokens 1..T-1 of each
window, window by window), in this order in the file:

    tokens           int32   [W, T]  the windows' token ids
    scale            float32 [N]     llama.cpp's compact logits (``calib.kl_divergence.CompactLogits``):
    min_log_prob     float32 [N]       ln p = scale · code + min_log_prob, to 1.3e-4 nats for every
    codes            uint16  [N, V]    token within 16 nats of the top, nothing stored below
    target_log_prob  float32 [N]     ln p of each target token, exact
    top_token        int32   [N]     the reference's most likely token

The metadata names the corpus, split, window count and length, vocabulary size, the reference
model's path, ``tokens_sha256`` (SHA-256 of the windows as little-endian int64) and
``content_sha256``: SHA-256 of the header (with that field zeroed) and all the data, so an edit
anywhere is refused. The file is written by hand, window batch by window batch, so that the codes
(2 bytes per vocabulary entry per position) never sit in memory all at once; safetensors reads it.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from calib.kl_divergence import CompactLogits
from compiler.errors import ConfigError
from compiler.io.atomic import atomic_file

FORMAT = "qcompile-kl-reference"
VERSION = "1"
HASH_KEY = "content_sha256"
UNSEALED = "0" * 64  # the hash field's value while the hash is computed
ITEM_BYTES = {"I32": 4, "F32": 4, "U16": 2}
TORCH_DTYPES = {"I32": torch.int32, "F32": torch.float32, "U16": torch.uint16}
PER_POSITION = (("scale", "F32"), ("min_log_prob", "F32"), ("target_log_prob", "F32"), ("top_token", "I32"))
AGAIN = "save a new one with qcompile eval CANDIDATE --reference MODEL --save-reference FILE"


@dataclass(frozen=True)
class ReferenceInfo:
    """What a reference file was computed on, from its metadata."""

    corpus: str
    split: str
    windows: int
    window_length: int
    vocab_size: int
    reference: str  # the reference model's path
    tokens_sha256: str

    @property
    def positions(self) -> int:
        return self.windows * (self.window_length - 1)

    def metadata(self, content_sha256: str) -> dict[str, str]:
        return {"format": FORMAT, "version": VERSION, **{k: str(v) for k, v in asdict(self).items()},
                HASH_KEY: content_sha256}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "ReferenceInfo":
        return cls(meta["corpus"], meta["split"], int(meta["windows"]), int(meta["window_length"]),
                   int(meta["vocab_size"]), meta["reference"], meta["tokens_sha256"])


def tokens_sha256(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def is_reference_file(spec: str | Path) -> bool:
    """A file that is not a .gguf: the only files ``--reference`` reads besides a model are reference files."""
    path = Path(spec)
    return path.is_file() and path.suffix != ".gguf"


# -- layout ------------------------------------------------------------------------------------


def _header(info: ReferenceInfo, content_sha256: str) -> dict:
    """The safetensors header: every tensor's dtype, shape and byte range, and the metadata."""
    n, v = info.positions, info.vocab_size
    shapes = [("tokens", "I32", [info.windows, info.window_length]),
              ("scale", "F32", [n]), ("min_log_prob", "F32", [n]), ("codes", "U16", [n, v]),
              ("target_log_prob", "F32", [n]), ("top_token", "I32", [n])]
    header, offset = {"__metadata__": info.metadata(content_sha256)}, 0
    for name, dtype, shape in shapes:
        size = math.prod(shape) * ITEM_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header


def _encode_header(header: dict) -> bytes:
    """The length prefix and JSON of a header, padded to 8 bytes as safetensors writes it."""
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _content_sha256(header: dict, data_chunks: Iterator[bytes]) -> str:
    h = hashlib.sha256(_encode_header({**header, "__metadata__": {**header["__metadata__"], HASH_KEY: UNSEALED}}))
    for chunk in data_chunks:
        h.update(chunk)
    return h.hexdigest()


def _read_chunks(f, start: int) -> Iterator[bytes]:
    f.seek(start)
    yield from iter(lambda: f.read(1 << 24), b"")


# -- writing -----------------------------------------------------------------------------------


class ReferenceWriter:
    """Streams a reference file: the header and windows first, then each batch's compact logits."""

    def __init__(self, path: Path, info: ReferenceInfo, windows: torch.Tensor):
        self.info, self.header = info, _header(info, UNSEALED)
        self.file = open(path, "wb+")
        self.data_start = len(_encode_header(self.header))
        self.file.write(_encode_header(self.header))
        self.file.write(windows.to(torch.int32).contiguous().numpy().tobytes())
        self.file.write(bytes(2 * 4 * info.positions))  # scale, min_log_prob: written in finish()
        self.written = 0
        self.per_position: dict[str, list[torch.Tensor]] = {"scale": [], "min_log_prob": [],
                                                            "target_log_prob": [], "top_token": []}

    def append(self, compact: CompactLogits) -> None:
        """The next positions, in window order."""
        self.file.write(compact.codes.contiguous().view(torch.int16).numpy().tobytes())
        for name, values in (("scale", compact.scale), ("min_log_prob", compact.min_log_prob),
                             ("target_log_prob", compact.target_log_probs), ("top_token", compact.top_tokens)):
            self.per_position[name].append(values)
        self.written += len(compact)

    def finish(self) -> None:
        if self.written != self.info.positions:
            raise RuntimeError(f"reference file: {self.written} positions written, {self.info.positions} expected")
        for name, dtype in PER_POSITION:
            values = torch.cat(self.per_position[name]).to(TORCH_DTYPES[dtype]).contiguous()
            self.file.seek(self.data_start + self.header[name]["data_offsets"][0])
            self.file.write(values.numpy().tobytes())
        self.file.flush()
        sealed = _header(self.info, _content_sha256(self.header, _read_chunks(self.file, self.data_start)))
        self.file.seek(0)
        self.file.write(_encode_header(sealed))  # the same length: only the hash's 64 hex digits changed
        self.file.close()


@contextmanager
def write_reference(path: str | Path, info: ReferenceInfo, windows: torch.Tensor) -> Iterator[ReferenceWriter]:
    """A writer for ``path``; the file appears (replacing any) only when the block ends without error."""
    with atomic_file(path, force=True) as tmp:
        writer = ReferenceWriter(tmp, info, windows)
        try:
            yield writer
            writer.finish()
        finally:
            writer.file.close()


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceFile:
    path: Path
    info: ReferenceInfo
    tokens: torch.Tensor  # [W, T] int64

    def positions(self, first_window: int, stop_window: int) -> CompactLogits:
        """The compact logits of windows [first_window, stop_window)."""
        from safetensors import safe_open

        start, stop = first_window * (self.info.window_length - 1), stop_window * (self.info.window_length - 1)
        with safe_open(str(self.path), framework="pt") as f:
            read = {name: f.get_slice(name)[start:stop] for name in ("codes", *(n for n, _ in PER_POSITION))}
        return CompactLogits(read["codes"], read["scale"], read["min_log_prob"], read["target_log_prob"], read["top_token"])

    def check_matches(self, windows: torch.Tensor, vocab_size: int, corpus: str, split: str) -> None:
        """A one-line ``ConfigError`` unless this file holds exactly the evaluation of ``windows``."""
        info, name = self.info, self.path
        if tuple(windows.shape) != (info.windows, info.window_length):
            raise ConfigError(f"reference file {name} holds {info.windows} windows of {info.window_length} tokens, "
                              f"this evaluation {windows.shape[0]} of {windows.shape[1]}: pass --windows {info.windows}, "
                              f"or {AGAIN}")
        if vocab_size != info.vocab_size:
            raise ConfigError(f"reference file {name} has a vocabulary of {info.vocab_size} tokens, the candidate "
                              f"{vocab_size}: compare models that share a tokenizer")
        if tokens_sha256(windows) != info.tokens_sha256:
            saved, here = f"corpus {info.corpus!r}, {info.split} region", f"corpus {corpus!r}, {split} region"
            why = (f"it was saved on {saved}, this evaluation reads {here}: pass --corpus {info.corpus} --split {info.split}"
                   if saved != here else f"the corpus text or the tokenizer changed since it was saved on {saved}")
            raise ConfigError(f"reference file {name} holds other tokens than this evaluation ({why}); or {AGAIN}")


def read_reference(path: str | Path) -> ReferenceFile:
    """Open a reference file, checking its format and checksum; a one-line ``ConfigError`` if it is not one."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    header, data_start = _read_header(path)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a qcompile reference file (no {FORMAT!r} metadata); {AGAIN}")
    if meta.get("version") != VERSION:
        raise ConfigError(f"{path} is a reference file of version {meta.get('version')}, this qcompile reads {VERSION}; {AGAIN}")
    with open(path, "rb") as f:
        if _content_sha256(header, _read_chunks(f, data_start)) != meta.get(HASH_KEY):
            raise ConfigError(f"{path}: checksum mismatch, the file was edited or is corrupt; {AGAIN}")
    try:
        info = ReferenceInfo.from_metadata(meta)
        if header != _header(info, meta[HASH_KEY]):
            raise ValueError("its tensors do not match its metadata")
        with safe_open(str(path), framework="pt") as f:
            tokens = f.get_tensor("tokens").long()
    except (KeyError, ValueError, SafetensorError) as e:
        raise ConfigError(f"{path}: not a readable reference file ({e}); {AGAIN}") from None
    return ReferenceFile(path, info, tokens)


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > min(size - 8, 1 << 24):
            raise ConfigError(f"{path} is not a qcompile reference file (not safetensors); {AGAIN}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError(f"{path} is not a qcompile reference file (its safetensors header is not JSON); {AGAIN}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a qcompile reference file (its safetensors header is not an object); {AGAIN}")
    return header, 8 + length
