"""Export a loaded artifact as the two-graph ONNX bundle (see ``backends/onnx/bundle.py``).

Both graphs reference one external-data file: the prefill graph is saved first with its
weights moved to ``weights.data``, and the decode graph's weight initializers are replaced by
the prefill's external references (same names, same offsets), so the weights are on disk once.

Every entry a pass declared in the artifact's manifest is either lowered or refused before
anything is written (``lowered_entries``): the FP8 or INT8 KV cache is rounded in the graphs; the serving
plan's paging settings do not apply to the bundle's contiguous cache, but a KV dtype it would
round K/V to and the bundle cannot hold is refused; anything else is refused.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from backends.onnx.bundle import DECODE_FILE, PREFILL_FILE, WEIGHTS_FILE, OnnxBundleInfo
from backends.onnx.graph import DEFAULT_ACCURACY_LEVEL, MATMULNBITS_ACCURACY_LEVELS, GraphSpec, build_graph
from backends.onnx.kv_rounding import kv_cache_export
from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import check_lowered_entries
from compiler.io.atomic import atomic_directory_write
from compiler.io.types import LoadedModel
from compiler.model.transformer import Transformer

EXTERNAL_THRESHOLD = 1024  # bytes: tensors above this go to weights.data
# What graph.py builds by hand: grouped-query attention (with Qwen3's and Gemma 3's q/k norms, per-
# layer windows and RoPE bases), Gemma's norms, embedding scale and soft-capping, the gated MLP
# (SwiGLU, GeGLU) and the routed experts of Qwen3-MoE and Mixtral (every expert on every token:
# backends/onnx/ffn.py). DeepSeek-V3's latent attention and grouped sigmoid router are not built,
# so it is refused here.
LOWERABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# The manifest entries passes declared (compiler.io.artifact.ArtifactRecord.extras) an ONNX bundle lowers.
LOWERED_ENTRIES = frozenset({"kv_cache", "serving"})


@dataclass(frozen=True)
class OnnxExportOptions:
    """``max_len``: cache length; ``dtype``: float32|float16; ``batch``: static batch or None;
    ``accuracy_level``: MatMulNBits' (``backends/onnx/graph.py``); ``fused_rotary``, ``fused_attention``,
    ``rotary_in_attention``: GraphSpec's (the dequantized, ATC-ready graphs keep to standard ops)."""

    max_len: int = 1024
    dtype: str = "float32"
    batch: int | None = None
    dequantize: bool = False  # export quantized layers as float (dequantized) weights
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    # com.microsoft RotaryEmbedding / GroupQueryAttention for ONNX Runtime; the dequantized (ATC-ready)
    # graphs keep to standard ops
    fused_rotary: bool = True
    fused_attention: bool = True
    rotary_in_attention: bool = True

    def validate(self, model: Transformer) -> None:
        arch = model.config.architecture
        if arch not in LOWERABLE_ARCHITECTURES:
            raise ConfigError(f"the ONNX export cannot lower {arch} yet (it lowers {', '.join(LOWERABLE_ARCHITECTURES)}); "
                              "serve it with the engine (qcompile generate) instead")
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"ONNX export dtype must be float32 or float16, got {self.dtype!r}")
        if not 1 <= self.max_len <= model.config.max_seq_len:
            raise ConfigError(f"--max-len {self.max_len} must be in 1..{model.config.max_seq_len} (the model's max_seq_len)")
        if self.accuracy_level not in MATMULNBITS_ACCURACY_LEVELS:
            raise ConfigError(f"MatMulNBits accuracy_level must be one of {MATMULNBITS_ACCURACY_LEVELS} "
                              f"(0 the input's type, 4 int8), got {self.accuracy_level!r}")


def layer_exports(model: Transformer, dequantize: bool, accuracy_level: int = 0) -> dict[str, str]:
    """How each quantized module, and an FP8 or INT8 KV cache (``layers.i.self_attn.kv_cache``), is
    exported (the report lists these; float layers and a float cache stay float)."""
    out = {}
    for name, m in quantized_modules(model).items():
        if isinstance(m, Int4Linear) and not dequantize:
            out[name] = f"MatMulNBits(bits=4, block_size={m.group_size}, accuracy_level={accuracy_level})"
        else:
            how = f"MatMul on the dequantized {m.format_name} weight"
            # Formats that also quantize activations (fp8 dynamic/static) lose that step: the graph
            # is weight-only, so its outputs differ from the artifact's by the activation rounding.
            if m.quantizes_activations:
                how += ", float activations (the artifact's activation quantization is not exported)"
            out[name] = how
    kv = kv_cache_export(model)
    if kv is not None:
        out.update({f"layers.{i}.self_attn.kv_cache": kv for i in range(len(model.layers))})
    return out


def lowered_entries(loaded: LoadedModel, target: str, cache_dtypes: set[str]) -> None:
    """Refuse, before anything is written, a manifest entry the bundle would not honour: one this
    lowering does not know, or a serving plan whose KV dtype is none of ``cache_dtypes`` (what the
    bundle's cache holds) nor the FP8 cache the graphs round K/V through."""
    record = loaded.manifest
    if record is None:  # a checkpoint, not an artifact: nothing was declared
        return
    where = loaded.source.path
    check_lowered_entries(record, target, LOWERED_ENTRIES, where)
    kv_dtype = (record.serving or {}).get("kv_dtype", "auto")
    fp8 = (record.kv_cache or {}).get("dtype")
    if kv_dtype not in cache_dtypes | {"auto", record.dtype_name, fp8} - {None}:
        raise ConfigError(f"{where}: its serving plan stores K/V as {kv_dtype}, which the {target} bundle's cache "
                          f"does not ({', '.join(sorted(cache_dtypes))}); serve it with the engine or Triton, "
                          "or compile with kv_dtype = \"auto\"")


def export_graphs(model: Transformer, opts: OnnxExportOptions) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The prefill and decode ModelProtos (weights inline)."""
    opts.validate(model)
    common = dict(max_len=opts.max_len, dtype=opts.dtype, batch=opts.batch, dequantize=opts.dequantize,
                  accuracy_level=opts.accuracy_level, fused_rotary=opts.fused_rotary and not opts.dequantize,
                  fused_attention=opts.fused_attention and not opts.dequantize,
                  rotary_in_attention=opts.rotary_in_attention)
    prefill = build_graph(model, GraphSpec("prefill", **common))  # T dynamic (ATC: gears)
    decode = build_graph(model, GraphSpec("decode", seq=1 if opts.batch is not None else None, **common))
    return prefill, decode


def save_graphs(prefill: onnx.ModelProto, decode: onnx.ModelProto, directory: Path) -> None:
    """Write both graphs into ``directory`` sharing ``weights.data``, then run the checker on each."""
    prefill_path, decode_path = directory / PREFILL_FILE, directory / DECODE_FILE
    onnx.save_model(prefill, str(prefill_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE, size_threshold=EXTERNAL_THRESHOLD)
    saved = onnx.load(str(prefill_path), load_external_data=False)
    external = {t.name: t for t in saved.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    for t in decode.graph.initializer:
        if t.name in external:
            t.CopyFrom(external[t.name])
    missing = [t.name for t in decode.graph.initializer
               if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > EXTERNAL_THRESHOLD]
    if missing:  # a decode-only weight would silently bloat decode.onnx; the graphs are built to share
        raise RuntimeError(f"decode graph has weights the prefill graph lacks: {missing[:3]}")
    onnx.save_model(decode, str(decode_path))
    for path in (prefill_path, decode_path):
        onnx.checker.check_model(str(path))


def bundle_info(loaded: LoadedModel, opts: OnnxExportOptions, target: str, extras: dict | None = None) -> OnnxBundleInfo:
    c = loaded.model.config
    return OnnxBundleInfo(target=target, dtype=opts.dtype, max_len=opts.max_len, n_layers=c.n_layers,
                          n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size, batch=opts.batch,
                          eos_token_ids=c.eos_token_ids, tokenizer=loaded.tokenizer is not None,
                          layers=layer_exports(loaded.model, opts.dequantize, opts.accuracy_level), extras=extras or {},
                          attention="gqa" if opts.fused_attention and not opts.dequantize else "standard")


def layer_counts(info: OnnxBundleInfo) -> dict[str, int]:
    """How many layers the bundle exports each way (the table ``qcompile lower`` shows)."""
    return dict(Counter(info.layers.values()))


def write_bundle_files(directory: Path, loaded: LoadedModel, graphs, info: OnnxBundleInfo) -> None:
    """Graphs, bundle.json and tokenizer into an (already temporary) directory."""
    save_graphs(*graphs, directory)
    info.write(directory)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(str(directory))


def default_dtype(model: Transformer) -> str:
    """The artifact's dtype where ONNX Runtime's CPU kernels have it; bfloat16 exports as float32."""
    dtype = next(model.parameters(), None)
    dtype = dtype.dtype if dtype is not None else torch.float32
    return "float16" if dtype == torch.float16 else "float32"


def export_onnx(loaded: LoadedModel, out: str | Path, opts: OnnxExportOptions, force: bool = False) -> OnnxBundleInfo:
    """Lower ``loaded`` to an ONNX Runtime bundle in ``out`` (written atomically)."""
    lowered_entries(loaded, "onnx", {opts.dtype})
    graphs = export_graphs(loaded.model, opts)
    info = bundle_info(loaded, opts, "onnx")
    atomic_directory_write(Path(out), lambda tmp: write_bundle_files(tmp, loaded, graphs, info), force)
    return info
