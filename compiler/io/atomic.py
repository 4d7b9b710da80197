"""Atomic writes: build a directory beside its destination, fsync it, rename it into place, so an
interrupted write never leaves a directory that looks complete. Every artifact, bundle and model
repository qcompile writes goes through ``atomic_directory_write``; result files (JSON, CSV)
through ``atomic_write_text``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from compiler.errors import ArtifactError


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _plain_modes(root: Path) -> None:
    """Give the tree the read permissions a plain mkdir / open would (the umask applied): mkdtemp
    makes the directory 0700 and some writers (safetensors' save_file) their files 0600, which
    another user — the server in a container that mounts the output — could not read."""
    mask = _umask()
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, os.stat(dirpath).st_mode & 0o7777 | (0o755 & ~mask))
        for f in files:
            path = os.path.join(dirpath, f)
            os.chmod(path, os.stat(path).st_mode & 0o7777 | (0o644 & ~mask))


def atomic_directory_write(out: Path, write, force: bool = False) -> None:
    """Call ``write(tmp_dir)``, then move tmp_dir to ``out`` in one rename (replacing it if ``force``)."""
    out = Path(out)
    if out.exists() and not force:
        raise ArtifactError(f"{out} already exists; choose another -o or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        _plain_modes(tmp)
        _fsync_tree(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_file_write(path: str | Path, write, force: bool = False) -> None:
    """Call ``write(tmp_path)`` beside ``path``, then rename the file into place."""
    with atomic_file(path, force) as tmp:
        write(tmp)


@contextmanager
def atomic_file(path: str | Path, force: bool = False) -> Iterator[Path]:
    """A temp path beside ``path`` to write (for a writer that streams); renamed into place when the
    block ends, removed if it raises."""
    path = Path(path)
    if path.exists() and not force:
        raise ArtifactError(f"{path} already exists; choose another -o or pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` beside ``path``, then rename it into place, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600, as a plain open would have made it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
