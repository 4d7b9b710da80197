"""The compiled artifact: a directory that runs without its source checkpoint.

    OUT/
      manifest.json       schema version, source + SHA-256, model config, pipeline config,
                          each pass's report, every tensor's dtype/shape/SHA-256, every
                          converted module's format, extras (e.g. the serving plan)
      model.safetensors   float tensors and the packed buffers of quantized modules; above 5 GiB,
                          shards model-0000i-of-0000n.safetensors + model.safetensors.index.json
                          (``compiler/io/shards.py``)
      tokenizer files     as the tokenizer saves them

Written atomically (a hidden temp directory beside OUT, fsync, rename), so an interrupted
compile never leaves a directory that looks complete.

Integrity: the manifest lists every tensor's SHA-256 and every tokenizer file's
(``tokenizer_files``), and the weights files' safetensors metadata holds the SHA-256 of the
manifest's content (its canonical JSON: sorted keys, no whitespace), so the two vouch for each
other. Reading the manifest checks its checksum and the tokenizer files (each present and
unchanged; the tokenizer is loaded from those files alone, so another file in the directory is
never read); loading also checks the schema version and every tensor's name, dtype, shape and
checksum. A corrupt,
truncated or edited artifact is a one-line ``ArtifactError``, never wrong outputs.

The manifest is written from an ``ArtifactRecord`` and read back as one (``read_manifest``), so
every reader goes through its typed attributes, never through the JSON's keys.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import compiler.formats.fp8  # noqa: F401  (registers the fp8 weight format)
import compiler.formats.gguf_block  # noqa: F401  (registers the gguf weight format)
import compiler.formats.int4  # noqa: F401  (registers the int4 weight format)
import compiler.formats.int8  # noqa: F401  (registers the int8 weight format)
from compiler.errors import ArtifactError, ConfigError
from compiler.formats.kv_quant import install_kv_quant
from compiler.formats.qlinear import format_class, quantized_modules
from compiler.io.atomic import atomic_directory_write
from compiler.io.shards import INDEX, WEIGHTS, ShardWriter, tensor_sha256, weight_files
from compiler.io.types import LoadedModel, SourceInfo, load_tokenizer, sha256_files
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer, rope_inv_freq

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_SHA_KEY = "qcompile_manifest_sha256"  # in the weights file's safetensors metadata
# What save_artifact itself writes; every other top-level key is an entry a pass declared
# (``PassContext.manifest_extras``: the FP8 KV cache, the serving plan, ...): ``ArtifactRecord.extras``,
# which each lowering must either lower or refuse (``check_lowered_entries``).
CORE_KEYS = frozenset({"schema_version", "created", "source", "model_config", "dtype", "pipeline", "passes",
                       "modules", "tensors", "aliases", "tokenizer", "tokenizer_files"})


def manifest_sha256(manifest: dict) -> str:
    """SHA-256 of the manifest's content: its canonical JSON (sorted keys, no whitespace), so
    re-indenting the file changes nothing and any edit of a value does."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage (tied embeddings): keep one name, record aliases.
    Empty tensors share no data, whatever their (null) pointers say."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t.detach()
    return unique, aliases


@dataclass
class ArtifactRecord:
    """An artifact's manifest, typed: the model, where it came from, how it was compiled (``pipeline``,
    each pass's report), and, filled in when the artifact is written, its converted modules, tensors,
    aliases and tokenizer files. ``extras``: the entries passes declared (``kv_cache``, ``serving``, …)."""

    config: ModelConfig
    dtype: torch.dtype
    source: SourceInfo
    pipeline: dict
    reports: list[dict]
    extras: dict = field(default_factory=dict)
    modules: dict[str, dict] = field(default_factory=dict)  # converted module -> its format entry
    tensors: dict[str, dict] = field(default_factory=dict)  # name -> {"dtype", "shape", "sha256"}
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the stored tensor's
    has_tokenizer: bool = False
    tokenizer_files: dict[str, str] | None = None  # file -> SHA-256; None: written before they were hashed
    created: str = ""
    sha256: str = field(default="", compare=False)  # read back: the content checksum the weights file vouches for

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_cache(self) -> dict | None:
        """The KV-cache entry a pass declared (``compiler/formats/kv_quant.py``), or None."""
        return self.extras.get("kv_cache")

    @property
    def serving(self) -> dict | None:
        """The serving plan the ``paged_kv`` pass recorded (``compiler/deploy/serving_plan.py``), or None."""
        return self.extras.get("serving")

    def to_json(self) -> dict:
        """The manifest's JSON object (its keys in the order they have always been written)."""
        files = {} if self.tokenizer_files is None else {"tokenizer_files": self.tokenizer_files}
        return {"schema_version": SCHEMA_VERSION, "created": self.created, "source": self.source.to_dict(),
                "model_config": self.config.to_dict(), "dtype": self.dtype_name, "pipeline": self.pipeline,
                "passes": self.reports, "modules": self.modules, "tensors": self.tensors, "aliases": self.aliases,
                "tokenizer": self.has_tokenizer, **files, **self.extras}

    @classmethod
    def from_json(cls, manifest: dict) -> "ArtifactRecord":
        """The record of a manifest's JSON object (KeyError, TypeError, … when it is not one)."""
        dtype = getattr(torch, manifest["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype {manifest['dtype']!r} is not a torch dtype")
        return cls(ModelConfig.from_dict(manifest["model_config"]), dtype, SourceInfo(**manifest["source"]),
                   manifest.get("pipeline", {}), manifest.get("passes", []),
                   {k: v for k, v in manifest.items() if k not in CORE_KEYS}, manifest["modules"], manifest["tensors"],
                   manifest.get("aliases", {}), manifest.get("tokenizer", False), manifest.get("tokenizer_files"),
                   manifest.get("created", ""))


def finish_artifact(tmp: Path, writer: ShardWriter, order: list[str], aliases: dict[str, str],
                    modules: dict[str, dict], record: ArtifactRecord, tokenizer: Any) -> None:
    """Write the manifest, the weights files and the tokenizer of an artifact into ``tmp``: the
    tensors ``writer`` holds, laid out and listed in ``order`` (the model's state-dict order), ``aliases`` (tied names) and
    ``modules`` (each converted module's format), ``record`` completed with them. An in-memory and a
    streamed compile of one model both end here, so they write the same bytes."""
    record = replace(record, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), modules=modules,
                     tensors={n: {"dtype": str(e.dtype).removeprefix("torch."), "shape": e.shape, "sha256": e.sha256}
                              for n, e in ((n, writer.entries[n]) for n in order)},
                     aliases=aliases, has_tokenizer=tokenizer is not None, tokenizer_files=save_tokenizer(tmp, tokenizer))
    text = json.dumps(record.to_json(), indent=1)
    digest = manifest_sha256(json.loads(text))  # of the content as a reader will parse it
    writer.write(order, {"format": "pt", MANIFEST_SHA_KEY: digest})
    (tmp / MANIFEST).write_text(text)


def save_tokenizer(folder: Path, tokenizer: Any) -> dict[str, str]:
    """Save ``tokenizer`` (None: nothing) into ``folder``; the SHA-256 of each file it wrote, by
    path relative to ``folder``. Every file that appears is counted, not the names ``save_pretrained``
    returns, so a file a tokenizer class writes beside them is covered too."""
    if tokenizer is None:
        return {}
    before = set(_files_under(folder))
    tokenizer.save_pretrained(str(folder))
    return {name: sha256_files([folder / name]) for name in sorted(set(_files_under(folder)) - before)}


def _files_under(folder: Path) -> list[str]:
    """Every file below ``folder`` (posix paths relative to it), hidden ones (the compile's spool,
    a file system's bookkeeping, which nothing loads) left out."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def save_artifact(out: str | Path, model: Transformer, tokenizer: Any, source: SourceInfo,
                  pipeline: dict, reports: list[dict], extras: dict | None = None, force: bool = False) -> Path:
    """Write the artifact directory of an in-memory model atomically and return its path."""
    state, aliases = dedupe_shared(model.state_dict())
    modules = {name: m.format_meta() for name, m in quantized_modules(model).items()}
    record = ArtifactRecord(model.config, model.embed_tokens.weight.dtype, source, pipeline, reports, extras or {})

    def write(tmp: Path):
        writer = ShardWriter(tmp, spool=False)
        for name, t in state.items():
            writer.add(name, t)
        finish_artifact(tmp, writer, list(state), aliases, modules, record, tokenizer)

    out = Path(out)
    atomic_directory_write(out, write, force)
    return out


def read_manifest(path: str | Path) -> ArtifactRecord:
    """The manifest of artifact ``path``, checked against the checksum its weights file holds (and its
    tokenizer files against theirs), as the record it was written from."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no {MANIFEST}; not a qcompile artifact (compile one with 'qcompile compile')") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path / MANIFEST}: corrupt ({e}); recompile the artifact") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path / MANIFEST}: not a JSON object; recompile the artifact")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(f"{path}: artifact schema version {version}, this qcompile reads {SCHEMA_VERSION}; recompile it")
    expected = _weights_metadata(path).get(MANIFEST_SHA_KEY)
    if expected is None:
        raise ArtifactError(f"{path}: {WEIGHTS} holds no manifest checksum (written by an older qcompile, or "
                            "not by qcompile); recompile the artifact")
    if manifest_sha256(manifest) != expected:
        raise ArtifactError(f"{path}: {MANIFEST} does not match the checksum its weights file holds (edited or "
                            "corrupt); recompile the artifact rather than editing it")
    try:
        record = replace(ArtifactRecord.from_json(manifest), sha256=expected)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # vouched for, yet not what qcompile writes
        raise ArtifactError(f"{path / MANIFEST}: not a qcompile manifest ({type(e).__name__}: {e}); "
                            "recompile the artifact") from None
    _check_tokenizer_files(path, record)
    return record


def _check_tokenizer_files(path: Path, record: ArtifactRecord, where: Path | None = None) -> None:
    """Each tokenizer file the manifest lists is there (in ``path``) and unchanged; errors name
    ``where`` (the artifact). Other files in the directory are not refused: the tokenizer is loaded
    from the listed files alone (``_load_tokenizer``).

    An artifact without ``tokenizer_files`` was written before tokenizer files were hashed; it
    loads as it always did (the tokenizer must be there when promised, ``load_artifact``), since
    the key's absence is vouched for by the manifest checksum checked above (removing it from a
    newer manifest is an edit, refused) and refusing would only force a recompile."""
    where = where or path
    for name, digest in (record.tokenizer_files or {}).items():
        if not (path / name).is_file():
            raise ArtifactError(f"{where}: tokenizer file {name} is missing; copy the whole artifact directory, "
                                "or recompile it")
        if sha256_files([path / name]) != digest:
            raise ArtifactError(f"{where}: tokenizer file {name} fails its checksum (edited or corrupt); recompile "
                                "the artifact rather than editing it")


def _load_tokenizer(path: Path, record: ArtifactRecord):
    """The artifact's tokenizer from exactly the files its manifest lists, copied into a private
    directory and checked there: the tokenizer loader reads whatever names its class looks for
    (vocab and merges files, added_tokens.json, chat templates, config.json), so a file dropped
    beside them — a note, an eval result, or one meant to change the tokenizer — is never read."""
    listed = record.tokenizer_files
    if listed is None:  # written before the hashes: read from the directory, as it always was
        return load_tokenizer(path)
    with tempfile.TemporaryDirectory(prefix="qcompile-tokenizer-") as tmp:
        for name in listed:
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path / name, Path(tmp) / name)
        _check_tokenizer_files(Path(tmp), record, path)  # the copies are what is read
        return load_tokenizer(Path(tmp))


def _weight_files(path: Path) -> list[Path]:
    """The artifact's weights files (``model.safetensors`` or its shards), each present."""
    try:
        files = weight_files(path)
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
        raise ArtifactError(f"{path / INDEX}: corrupt ({type(e).__name__}: {e}); recompile the artifact") from None
    for f in files:
        if not f.is_file():
            raise ArtifactError(f"{path}: no {f.name}; the artifact is incomplete, recompile it")
    return files


def _weights_metadata(path: Path) -> dict[str, str]:
    """The weights files' safetensors metadata (their headers only; the tensors are not read);
    every shard must hold the same."""
    from safetensors import SafetensorError, safe_open

    found = None
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                metadata = f.metadata() or {}
        except (SafetensorError, OSError) as e:
            raise ArtifactError(f"{file}: unreadable ({_first_line(e)}); the artifact is corrupt or truncated, "
                                "recompile it") from None
        if found is not None and metadata != found:
            raise ArtifactError(f"{file}: its metadata differs from the first shard's (shards of two compiles); "
                                "recompile the artifact")
        found = metadata
    return found


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _read_tensors(path: Path, expected: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Every tensor the manifest lists (``expected``), each checked for dtype, shape and SHA-256 (memory-mapped)."""
    from safetensors import SafetensorError, safe_open

    state, extra = {}, []
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in expected:
                        state[name] = f.get_tensor(name)
                    else:
                        extra.append(name)
        except (SafetensorError, OSError) as e:
            raise ArtifactError(f"{file}: unreadable ({_first_line(e)}); the artifact is corrupt or truncated, "
                                "recompile it") from None
    missing, extra = sorted(set(expected) - state.keys()), sorted(extra)
    if missing or extra:
        what = "; ".join(f"{label} {names[:3]}{f' (+{len(names) - 3} more)' if len(names) > 3 else ''}"
                         for label, names in (("missing", missing), ("not in the manifest", extra)) if names)
        raise ArtifactError(f"{path}: weights do not match the manifest ({what}); the artifact is corrupt, recompile it")
    for name, meta in expected.items():
        check_tensor(path, name, state[name], meta)
    return state


def check_tensor(path: Path, name: str, t: torch.Tensor, meta: dict) -> None:
    """Raise ``ArtifactError`` unless ``t`` has the dtype, shape and SHA-256 the manifest gives it."""
    got = (str(t.dtype).removeprefix("torch."), list(t.shape))
    if got != (meta["dtype"], list(meta["shape"])):
        raise ArtifactError(f"{path}: tensor {name} is {got[0]} {got[1]}, the manifest says {meta['dtype']} "
                            f"{meta['shape']}; the artifact is corrupt, recompile it")
    if tensor_sha256(t) != meta["sha256"]:
        raise ArtifactError(f"{path}: tensor {name} fails its checksum; the artifact is corrupt, recompile it")


def build_from_manifest(record: ArtifactRecord, state: dict[str, torch.Tensor], where: str = "artifact") -> Transformer:
    """The model the manifest describes, with ``state``'s tensors assigned (``where`` names it in errors)."""
    config, dtype = record.config, record.dtype
    with torch.device("meta"):
        model = Transformer(config)
    for name, meta in record.modules.items():
        try:
            linear = model.get_submodule(name)
            cls = format_class(meta["format"])
        except AttributeError:
            raise ArtifactError(f"{where}: the manifest converts module {name!r}, which its model config does not "
                                "have; recompile the artifact") from None
        except ArtifactError as e:
            raise ArtifactError(f"{where}: {e}") from None
        with torch.device("meta"):
            q = cls.empty(meta, linear.in_features, linear.out_features, linear.bias is not None, dtype)
        model.set_submodule(name, q)
    for alias, target in record.aliases.items():
        state[alias] = state[target]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ArtifactError(f"{where}: tensors do not fit its model config ({_first_line(e)}); recompile it") from None
    if config.tie_embeddings and "lm_head.weight" in record.aliases:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    if record.kv_cache:
        try:
            install_kv_quant(model, record.kv_cache)
        except ArtifactError as e:
            raise ArtifactError(f"{where}: {e}") from None
    return model.eval()


def load_artifact(path: str | Path) -> LoadedModel:
    """The runnable model (``forward(input_ids[B, T]) -> logits[B, T, V]``) and tokenizer of an artifact."""
    path = Path(path)
    record = read_manifest(path)
    model = build_from_manifest(record, _read_tensors(path, record.tensors), str(path))
    tokenizer = None
    if record.has_tokenizer:
        tokenizer = _load_tokenizer(path, record)
        if tokenizer is None:
            raise ArtifactError(f"{path}: the manifest lists a tokenizer but the artifact holds no tokenizer files; "
                                "copy the whole artifact directory, or recompile it")
    source = SourceInfo(str(path.resolve()), "artifact", sha256_files([path / MANIFEST]),
                        sum(f.stat().st_size for f in _weight_files(path)))
    return LoadedModel(model, tokenizer, source, record)


def check_lowered_entries(record: ArtifactRecord, target: str, lowered: set[str] | frozenset[str], where: str) -> None:
    """Refuse an artifact that declares a manifest entry (one a pass added: ``record.extras``) that
    ``target``'s lowering does not handle, so no later pass's format is dropped silently."""
    unknown = sorted(set(record.extras) - set(lowered))
    if unknown:
        raise ConfigError(f"{where}: the artifact declares {', '.join(map(repr, unknown))}, which the {target} "
                          f"lowering does not know (it lowers {', '.join(sorted(lowered)) or 'no pass entries'}); "
                          "lower to another target or compile without the pass that wrote it")
