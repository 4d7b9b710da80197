"""Writing an artifact as a compressed-tensors checkpoint that stock vLLM loads.

    OUT/
      config.json                       the Hugging Face model config + ``quantization_config``
      model.safetensors                 (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
      tokenizer files                   as the artifact's tokenizer saves them
      qcompile_export.json              where it came from: the artifact's manifest hash, the checkpoint's
                                        dtype and notes, per-layer schemes

Tensor names are the Hugging Face ones (``model.layers.0.self_attn.q_proj.weight_packed``).
The quantized tensors are the artifact's own codes and scales, moved into compressed-tensors'
layout, never re-quantized (``backends/vllm/tensors.py``); the schemes are in
``backends/vllm/schemes.py``. Everything vLLM could not run is refused before anything is written.
A float32 model with INT4 layers is written in float16, the dtype vLLM's INT4 kernels run in: its
INT4 scales are float16 values already (``compiler.quant.int4.storage_scale``), so only the float
tensors are rounded, and ``qcompile_export.json``'s notes (which ``qcompile lower`` prints) say by how much.

Every entry a pass declared in the manifest is read (``LOWERED_ENTRIES``; any other is refused):
the FP8 KV cache becomes ``kv_cache_scheme`` and per-layer ``k_scale``/``v_scale``; of the serving
plan, the KV dtype is what changes the numbers, so it is honoured (the model dtype, or the FP8
cache) or refused; its paging and batching settings (block size and count, batch limits, prefix
caching, the engine's fusion and weight packing) size and schedule qcompile's engine, not the
model: vLLM sizes its cache and batches by its own settings (``VLLM_CPU_KVCACHE_SPACE``, its engine
arguments), and the plan is recorded in ``qcompile_export.json``.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.vllm.schemes import FUSED_SETS, MODEL_TYPES, checkpoint_dtype, ct_scheme, kv_cache_scheme
from backends.vllm.tensors import fp8_tensors, int4_tensors, int8_tensors, kv_scale_tensors
from compiler.deploy.targets import DeploymentPlan, LowerResult, check_formats, check_plan
from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.formats.int8 import Int8Linear
from compiler.options import option
from compiler.formats.qlinear import linear_modules, quantized_modules
from compiler.io.artifact import MANIFEST, ArtifactRecord, check_lowered_entries, load_artifact, read_manifest
from compiler.io.atomic import atomic_directory_write
from compiler.io.types import sha256_files
from compiler.model.architectures import FULL, SLIDING
from compiler.model.config import ModelConfig
from compiler.quant.int4 import storage_scale

# The compressed-tensors release whose loader this layout was checked against (its decompressor
# in tests/backends/vllm, and vLLM 0.32's CPU kernels); compressed-tensors writes its own version here.
CT_VERSION = "0.17.0"
EXPORT_FILE = "qcompile_export.json"
# The manifest entries passes declared (ArtifactRecord.extras) this export reads: the FP8 KV cache
# and the serving plan (module docstring).
LOWERED_ENTRIES = frozenset({"kv_cache", "serving"})


@dataclass(frozen=True)
class VllmLowerOptions:
    """Options of ``qcompile lower --target vllm`` (API: ``lower(..., options={"shard_size_mb": 512})``)."""

    shard_size_mb: int = option(4096, "vllm: the largest safetensors shard in MB; more tensors go into further shards.")

    def __post_init__(self):
        if self.shard_size_mb < 1:
            raise ValueError(f"shard_size_mb must be >= 1, got {self.shard_size_mb}")


def hf_name(module: str) -> str:
    """Our module name -> the Hugging Face checkpoint's (decoder weights live under ``model.``)."""
    return module if module == "lm_head" or module.startswith("lm_head.") else f"model.{module}"


def check_artifact(record: ArtifactRecord, where: str) -> None:
    """Raise ConfigError, before any work, for anything in the artifact vLLM cannot run exactly:
    an entry this export does not know, a module format, or the plan as a whole (KV cache, serving plan)."""
    check_lowered_entries(record, "vllm", LOWERED_ENTRIES, where)
    check_formats("vllm", record.modules, where)
    plan = DeploymentPlan(record.dtype_name, record.modules, kv_cache=record.kv_cache, config=record.config,
                          serving=record.serving)
    check_plan("vllm", plan, where)


def _check_static_input_scales(model: torch.nn.Module, modules: dict[str, dict], where: str) -> None:
    """vLLM keeps one input scale per fused layer (the largest): static q/k/v and gate/up must share theirs."""
    for name, fmt in modules.items():
        group = next((g for g in FUSED_SETS if name.endswith("." + g[0])), None)
        if group is None or fmt.get("activation_scheme") != "static":
            continue
        block = name[: -len(group[0])]  # check_fused made the siblings the same static scheme
        members = [model.get_submodule(block + n) for n in group]
        scales = {(float(m.input_scale), None if getattr(m, "input_zero_point", None) is None
                   else int(m.input_zero_point)) for m in members}
        if len(scales) > 1:
            raise ConfigError(f"{where}: target 'vllm' cannot run {block.rstrip('.')}'s "
                              f"{'/'.join(n.rpartition('.')[2] for n in group)} with different static input scales "
                              f"{sorted(scales)} (vLLM keeps one range for the fused layer); use activation_scheme = \"dynamic\"")


def _rope_parameters(theta: float, scaling: dict | None) -> dict:
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # "type": the older spelling
    return {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": rope_type, "rope_theta": theta}


def _architecture_fields(config: ModelConfig) -> dict:
    """The ``config.json`` fields that differ per architecture (the inverse of compiler/model/hf_config.py)."""
    arch = config.architecture
    if arch == "Qwen2ForCausalLM":
        return dict(use_sliding_window=False, sliding_window=None)
    fields = dict(attention_bias=config.qkv_bias)
    if arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        fields["mlp_bias"] = config.mlp_bias
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        fields["sliding_window"] = config.sliding_window
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        fields |= dict(use_sliding_window=False, sliding_window=None)
    if arch == "Gemma3ForCausalLM":
        scalar = config.query_pre_attn_scalar
        if not float(scalar).is_integer():
            raise ConfigError(f"Gemma 3 with query_pre_attn_scalar={scalar}: Hugging Face's config (which vLLM reads) "
                              "holds an integer; this artifact cannot be exported")
        fields |= dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(scalar),
                       sliding_window=config.sliding_window, layer_types=config.layer_types,
                       final_logit_softcapping=config.final_logit_softcapping, attn_logit_softcapping=None,
                       rope_parameters={FULL: _rope_parameters(config.rope_theta, config.rope_scaling),
                                        SLIDING: _rope_parameters(config.rope_local_theta or 10_000.0, None)})
    if arch == "Qwen3MoeForCausalLM":
        moe = set(range(config.n_layers)) if config.moe_layers is None else set(config.moe_layers)
        fields |= dict(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                       moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=sorted(set(range(config.n_layers)) - moe))
    if arch == "MixtralForCausalLM":  # every layer routed, experts intermediate_size wide, top-k renormalised
        fields |= dict(num_local_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok)
    return fields


def hf_config(config: ModelConfig, dtype: str) -> dict:
    """The Hugging Face ``config.json`` of ``config``, built by transformers' own config class."""
    from transformers import AutoConfig

    arch = config.architecture
    if arch != "Qwen2ForCausalLM" and config.qkv_bias != config.o_bias:
        raise ConfigError(f"{arch} with a q/k/v bias but {'an' if config.o_bias else 'no'} o_proj bias has no "
                          "Hugging Face config (attention_bias covers all four); this artifact cannot be exported")
    fields = dict(vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.intermediate_size,
                  num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                  num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_act="silu",
                  rms_norm_eps=config.norm_eps, max_position_embeddings=config.max_seq_len,
                  rope_parameters=_rope_parameters(config.rope_theta, config.rope_scaling),
                  tie_word_embeddings=config.tie_embeddings, bos_token_id=config.bos_token_id,
                  eos_token_id=config.eos_token_id, dtype=dtype)
    fields |= _architecture_fields(config)
    if arch == "Gemma3ForCausalLM":
        del fields["hidden_act"]
    hf = AutoConfig.for_model(MODEL_TYPES[arch], **fields).to_diff_dict()  # what save_pretrained writes
    hf["architectures"] = [arch]
    return hf


def quantization_config(model: torch.nn.Module, modules: dict[str, dict], kv_cache: dict | None) -> dict:
    """``config.json``'s ``quantization_config``: one config group per distinct scheme, targets by layer name."""
    groups: dict[str, list[str]] = defaultdict(list)
    schemes: dict[str, dict] = {}
    for name, fmt in modules.items():
        scheme = ct_scheme(fmt)
        key = json.dumps(scheme, sort_keys=True)
        schemes[key] = scheme
        groups[key].append(hf_name(name))
    config_groups = {}
    for i, (key, targets) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        scheme = schemes[key]
        config_groups[f"group_{i}"] = {"targets": targets, "weights": scheme["weights"],
                                       "input_activations": scheme["input_activations"], "output_activations": None,
                                       "format": scheme["format"]}
    formats = sorted({g["format"] for g in config_groups.values()})
    ignore = [hf_name(n) for n in linear_modules(model)]  # the float linears (lm_head among them)
    return {"quant_method": "compressed-tensors", "version": CT_VERSION,
            "format": formats[0] if len(formats) == 1 else "mixed-precision", "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": ignore, "kv_cache_scheme": kv_cache_scheme(kv_cache),
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def _check_half_scales(quantized: dict[str, torch.nn.Module], where: str) -> None:
    """A float32 model's INT4 layers go into a float16 checkpoint with their scales unchanged: refuse
    scales that float16 does not hold exactly (artifacts written before scales were kept so)."""
    for name, module in quantized.items():
        if isinstance(module, Int4Linear) and not torch.equal(storage_scale(module.scales, torch.float32), module.scales):
            raise ConfigError(f"{where}: {name}'s INT4 scales are finer than float16, and vLLM runs INT4 layers in "
                              "float16 (this artifact predates qcompile's float16 scales); compile it again")


def weight_only_int8_rounding(model: torch.nn.Module, dtype: str) -> list[str]:
    """vLLM's W8A16 layers hold their scales in the model dtype: a note of how far that rounds the
    artifact's float32 ones (none in a float32 checkpoint)."""
    scales = [m.weight_scale for m in quantized_modules(model).values()
              if isinstance(m, Int8Linear) and not m.quantizes_activations]
    if not scales or dtype == "float32":
        return []
    s = torch.cat(scales)
    change = float(((s.to(getattr(torch, dtype)).float() - s).abs() / s).max())
    return [f"INT8 weight-only layers hold their scales in {dtype} in vLLM: the artifact's float32 scales move by up "
            f"to {change:.1e} (relative)"] if change else []


def half_rounding(model: torch.nn.Module, where: str) -> float:
    """What writing a float32 model's float tensors (all but its INT4 layers' codes and scales) in float16
    changes: the largest change relative to its tensor's largest magnitude. Refuses values float16 cannot hold."""
    quantized = quantized_modules(model)
    worst, limit = 0.0, torch.finfo(torch.float16).max
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if not tensor.is_floating_point() or (module in quantized and leaf != "bias"):
            continue
        top = float(tensor.abs().max()) if tensor.numel() else 0.0
        if top > limit:
            raise ConfigError(f"{where}: {name} holds {top:.3g}, beyond float16's range, and vLLM runs INT4 layers in "
                              "float16; compile it in bfloat16 (set [model] dtype)")
        if top:
            worst = max(worst, float((tensor.to(torch.float16).float() - tensor.float()).abs().max()) / top)
    return worst


def checkpoint_tensors(model: torch.nn.Module, record: ArtifactRecord, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its Hugging Face name (tied lm_head left out, as HF does),
    the float ones in ``dtype``; the FP8 formats' float32 scales stay float32 (``backends/vllm/tensors.py``)."""
    quantized = quantized_modules(model)
    converters = {"int4": int4_tensors, "int8": int8_tensors, "fp8": fp8_tensors}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in quantized or (name == "lm_head.weight" and model.config.tie_embeddings):
            continue
        out[hf_name(module) + "." + leaf] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    for name, module in quantized.items():
        fmt = record.modules[name]
        for leaf, tensor in converters[fmt["format"]](module, fmt).items():
            weight_only_int8 = fmt["format"] == "int8" and fmt["activation_scheme"] == "none"
            cast = ((fmt["format"] == "int4" or weight_only_int8) and tensor.is_floating_point()) or leaf == "bias"
            out[f"{hf_name(name)}.{leaf}"] = (tensor.to(dtype) if cast else tensor).contiguous()
    if record.kv_cache:
        out |= {hf_name(k): v for k, v in kv_scale_tensors(record.kv_cache).items()}
    return out


def _shards(tensors: dict[str, torch.Tensor], limit_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    return shards + [current] if current else shards


def write_shards(out: Path, tensors: dict[str, torch.Tensor], limit_bytes: int, stem: str = "model") -> list[str]:
    """``{stem}.safetensors``, or numbered shards ``{stem}-0000i-of-0000n.safetensors`` with the index
    ``{stem}.safetensors.index.json`` that transformers and vLLM read (``stem``: msModelSlim's names too)."""
    from safetensors.torch import save_file

    shards = _shards(tensors, limit_bytes) or [{}]
    if len(shards) == 1:
        save_file(shards[0], str(out / f"{stem}.safetensors"), metadata={"format": "pt"})
        return [f"{stem}.safetensors"]
    names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / f"{stem}.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    return names


def export_vllm(artifact: str | Path, out: str | Path, opts: VllmLowerOptions = VllmLowerOptions(),
                force: bool = False) -> LowerResult:
    """Write ``artifact`` as a compressed-tensors checkpoint directory ``out`` (atomically); its notes
    are in ``qcompile_export.json`` too."""
    artifact, out = Path(artifact), Path(out)
    record = read_manifest(artifact)
    check_artifact(record, str(artifact))
    loaded = load_artifact(artifact)
    if loaded.tokenizer is None:
        raise ConfigError(f"{artifact}: the artifact holds no tokenizer, and vLLM needs one; compile from a "
                          "checkpoint that ships its tokenizer")
    model, modules = loaded.model, record.modules
    _check_static_input_scales(model, modules, str(artifact))
    dtype = checkpoint_dtype(record.dtype_name, modules)
    notes = weight_only_int8_rounding(model, dtype)
    if dtype != record.dtype_name:
        _check_half_scales(quantized_modules(model), str(artifact))
        notes.append(f"written in {dtype}, as vLLM runs INT4 layers: the INT4 codes, scales and zero points are the "
                     f"artifact's own; its other {record.dtype_name} tensors are rounded, by at most "
                     f"{half_rounding(model, str(artifact)):.1e} of each tensor's largest value")
    config = hf_config(model.config, dtype)
    if modules or record.kv_cache:
        config["quantization_config"] = quantization_config(model, modules, record.kv_cache)
    tensors = checkpoint_tensors(model, record, getattr(torch, dtype))
    export = {"artifact": str(artifact.resolve()), "manifest_sha256": sha256_files([artifact / MANIFEST]),
              "dtype": dtype, "notes": notes,
              "schemes": {hf_name(n): ct_scheme(f)["format"] for n, f in modules.items()},
              "kv_cache": record.kv_cache, "serving": record.serving}

    def write(tmp: Path):
        files = write_shards(tmp, tensors, opts.shard_size_mb << 20)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        loaded.tokenizer.save_pretrained(str(tmp))
        (tmp / EXPORT_FILE).write_text(json.dumps({**export, "files": files}, indent=2))

    atomic_directory_write(out, write, force)
    return LowerResult(out, notes)

