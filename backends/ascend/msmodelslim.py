"""The directory vllm-ascend loads: msModelSlim's "AscendV1" layout, written by ``qcompile lower
--target ascend`` as ``vllm-ascend/`` beside the ATC bundle (``vllm serve D/vllm-ascend`` on a host
with vllm-ascend; it detects the layout by ``quant_model_description.json``).

What it follows (checked against the source; tests/backends/ascend/test_ascend_v1.py mirrors it):

* vllm-ascend 0.23.0 (the PyPI wheel) and its main branch at 182b75ea:
  ``vllm_ascend/quantization/utils.py`` (detection: ``quant_model_description.json`` in the model
  directory), ``vllm_ascend/quantization/modelslim_config.py`` (``MODELSLIM_CONFIG_FILENAME``; a
  layer's type is ``description["<prefix>.weight"]``, ``FLOAT`` = unquantized, the shards of a fused
  q/k/v or gate/up must agree; ``lm_head.weight`` and ``model.embed_tokens.weight`` must be
  listed), ``vllm_ascend/quantization/methods/{w8a8_static,w8a8_dynamic,w8a16}.py`` (the
  parameters each scheme creates, below; every float one in the model dtype ``dt``);
* msModelSlim's AscendV1 saver (``msmodelslim/core/quant_service/modelslim_v1/save/ascendv1.py``
  and ``save/utils/deqscale.py``, Ascend/msmodelslim at 030d6ea4): the description's fixed keys,
  the file names, ``deq_scale``, ``quant_bias`` and ``deqscale2int64``, and the C8 KV cache
  (``on_dynamic_cache``: ``kv_cache_type`` / ``kv_quant_type`` "C8", per-layer tensors typed "C8");
* the INT8 KV cache ("C8") in vllm-ascend at 182b75ea: ``modelslim_config.py``
  (``_add_kvcache_quant_metadata``: enabled by ``kv_cache_type`` "C8", its layers those of the keys
  holding ``k_proj.kv_cache_scale``; ``get_cache_scale_mapper``: ``.k_proj.kv_cache_scale`` ->
  ``.attn.k_cache_scale`` and so on), ``methods/kv_c8.py`` (``AscendC8KVCacheAttentionMethod``: the
  four parameters in the model dtype, the loader squeezes and casts) and ``attention/attention_v1.py``
  (``AscendC8AttentionBackendImpl``: ``_prepare_c8_scales``, n_kv_heads × head_size per channel,
  head-major; ``_quantize_kv_to_int8``, codes = clamp(round(x * (1 / scale) + offset), -128, 127);
  ``_dequant_paged_kv_to_dense``, codes * scale, the offset ignored; ``_nz_5d_view``, blocks of 32
  channels).

Files::

    config.json                       the Hugging Face config (backends/vllm/export.py's hf_config),
                                      without quantization_config
    tokenizer files                   as the artifact's tokenizer saves them (when it has one)
    quant_model_description.json      {"version": "1.0.0", "model_quant_type": T, "metadata": {},
                                       "group_size": 0, "optional": {}, "<tensor>": its type, ...}
    quant_model_weights.safetensors   (or quant_model_weights-0000i-of-0000n.safetensors and
                                      quant_model_weights.safetensors.index.json, msModelSlim's
                                      4 GiB parts; vLLM reads every *.safetensors of the directory)

Per ``Int8Linear`` (HF prefix P, N outputs, K inputs):

    W8A8_DYNAMIC (dynamic, symmetric per token)
      P.weight        int8 [N, K]    the artifact's codes
      P.weight_scale  dt   [N, 1]    the artifact's float32 scales, rounded to dt
      P.weight_offset dt   [N, 1]    zeros
    W8A8 (static per tensor)
      P.weight, P.weight_scale, P.weight_offset as above
      P.input_scale   dt   [1]       the calibrated scale s, rounded to dt (s')
      P.input_offset  int8 [1]       the zero point z (0 when symmetric): the NPU quantizes
                                     q = clamp(round(x / s') + z, -128, 127) (npu_quantize)
      P.deq_scale     [N]            float32 s' * weight_scale (bfloat16 models); float16 models: its
                                     float32 bits as int64 (msModelSlim's deqscale2int64)
      P.quant_bias    int32 [N]      round(bias / deq_scale - z * sum_k weight[n, k]) (msModelSlim's
                                     formula; npu_quant_matmul computes (q @ weight.T + quant_bias) *
                                     deq_scale, so the zero point term is exact and a float bias is
                                     rounded to a multiple of deq_scale: the notes say by how much)
    W8A16 (activation_scheme "none")
      P.weight, P.weight_scale, P.weight_offset as above (w = (weight + offset) * scale)
    P.bias            dt [N], FLOAT, when the layer has one (W8A8 folds it into quant_bias as well)

Every other tensor is FLOAT under its Hugging Face name (embeddings, norms, lm_head — listed even
when tied to the embedding, whose tensor vLLM then skips — and float layers).

An INT8 KV cache (the manifest's ``kv_cache``, int8 per channel) is vllm-ascend's C8: the description
gets ``"kv_cache_type": "C8"`` and ``"kv_quant_type": "C8"``, and per layer i, for P in
``model.layers.i.self_attn.k_proj`` and ``...v_proj`` (type "C8"):

      P.kv_cache_scale  dt [Hkv * D]   the artifact's scales (head-major), rounded to dt (the int8
                                       pass puts them on bfloat16's grid, so they are held exactly)
      P.kv_cache_offset dt [Hkv * D]   zeros: the cache is symmetric (vllm-ascend's dense dequant
                                       ignores the offset)

Refused before anything is written (``check_ascend_v1``, one line each, with what to compile
instead): dynamic asymmetric activations (vllm-ascend's W8A8_DYNAMIC is symmetric per token), a
fused q/k/v or gate/up whose layers disagree (scheme, or static scale and zero point: vllm-ascend
keeps one per fused layer), a static zero point outside int8, an FP8 KV cache (AscendV1's one KV
cache is C8) and an INT8 one with a head_dim not a multiple of 32 (C8 blocks hold 32 channels). Formats with no AscendV1 form — INT4 (vllm-ascend has W4A16 for MoE
experts only), FP8, GGUF — and mixture-of-experts models get no directory; ``ascend_v1_skip`` says
why and the lowering writes that in its notes (the ATC bundle is written all the same).

A float32 artifact is written in bfloat16 (``serving_dtype``: the NPU's INT8 matmuls return float16
or bfloat16, and W8A8 has no float32 deq_scale): codes unchanged, its float tensors rounded, by as
much as the notes say. What vllm-ascend computes differs from the artifact only where its parameters or kernels force it,
and ``prepare_ascend_v1``'s notes (printed by ``qcompile lower``, kept in bundle.json) say by how much:
it holds weight and static input scales in the model dtype (the artifact's are float32) and
quantizes by the input scale's reciprocal, also in the model dtype (exact when the scale is a power
of two); W8A8 folds a float bias into the integer quant_bias (within half a deq_scale step);
npu_quantize clamps to -128..127 where a symmetric artifact clamps to -127..127 (inputs beyond the
calibrated range), and rounds x / s + z as one where the artifact rounds x / s and adds z (one step
apart exactly half-way, with an odd z); the C8 cache quantizes K/V by its scales' reciprocal in the
model dtype too. Codes, integer sums and the zero-point term are the artifact's
(tests/backends/ascend/test_ascend_v1.py computes the NPU's arithmetic from the files).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from compiler.errors import ConfigError
from compiler.formats.int8 import Int8Linear
from compiler.formats.kv_quant import INT8, Int8KVQuant
from compiler.formats.qlinear import quantized_modules
from compiler.io.types import LoadedModel

DIRECTORY = "vllm-ascend"
DESCRIPTION_FILE = "quant_model_description.json"  # vllm-ascend's MODELSLIM_CONFIG_FILENAME
WEIGHTS_PREFIX = "quant_model_weights"  # msModelSlim's ASCENDV1_SAFETENSORS_NAME without ".safetensors"
WEIGHTS_FILE = f"{WEIGHTS_PREFIX}.safetensors"
INDEX_FILE = f"{WEIGHTS_PREFIX}.safetensors.index.json"
VERSION = "1.0.0"
PART_BYTES = 4 << 30  # msModelSlim's default part_file_size (4 GB)
FLOAT = "FLOAT"
W8A8, W8A8_DYNAMIC, W8A16 = "W8A8", "W8A8_DYNAMIC", "W8A16"
C8 = "C8"  # vllm-ascend's INT8 KV cache
C8_BLOCK = 32  # channels per NZ block of its cache (attention_v1.py's _nz_5d_view)
# msModelSlim's QUANT_TYPE_PRIORITY (ascendv1.py): model_quant_type is the highest one present.
PRIORITY = (FLOAT, W8A16, W8A8_DYNAMIC, W8A8)
# The layers vLLM fuses into one (its Llama/Qwen packed_modules_mapping: qkv_proj, gate_up_proj).
FUSED_SETS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
HALF_DTYPES = ("bfloat16", "float16")


def hf_name(name: str) -> str:
    """Our module names are Hugging Face's without the ``model.`` prefix (lm_head has none)."""
    return name if name == "lm_head" or name.startswith("lm_head.") else f"model.{name}"


def quant_type(module: Int8Linear) -> str:
    fmt = module.format
    if fmt.activation_scheme == "none":
        return W8A16
    return W8A8 if fmt.static else W8A8_DYNAMIC


def ascend_v1_skip(loaded: LoadedModel) -> str | None:
    """Why ``loaded`` has no AscendV1 form at all (the ATC bundle is still written), or None."""
    from backends.vllm.schemes import MODEL_TYPES

    config = loaded.model.config
    if config.architecture not in MODEL_TYPES:
        return f"{config.architecture} has no Hugging Face config this export writes ({', '.join(MODEL_TYPES)})"
    if config.num_experts:
        return (f"{config.architecture} is a mixture-of-experts model, whose experts this layout does not write; "
                "serve the ATC bundle")
    other = sorted({m.format_name for m in quantized_modules(loaded.model).values() if not isinstance(m, Int8Linear)})
    if not other:
        return None
    why = {"int4": "vllm-ascend runs INT4 weight-only (W4A16) for MoE experts only, not dense layers",
           "fp8": "AscendV1 has no FP8 weight layout for vllm-ascend's dense layers"}
    reasons = "; ".join(why.get(f, f"{f!r} layers have no AscendV1 form") for f in other)
    return f"{reasons}; compile with the int8 pass for vllm-ascend (W8A8 / W8A8_DYNAMIC / W8A16)"


def check_ascend_v1(loaded: LoadedModel) -> None:
    """ConfigError (one line) for an INT8 artifact the AscendV1 layout cannot hold exactly as declared."""
    where = loaded.source.path
    if why := c8_refusal(loaded.manifest and loaded.manifest.kv_cache, loaded.model.config.head_dim):
        raise ConfigError(f"{where}: {why}")
    int8 = {n: m for n, m in quantized_modules(loaded.model).items() if isinstance(m, Int8Linear)}
    if not int8:
        return
    for name, m in int8.items():
        fmt = m.format
        if fmt.activation_scheme == "dynamic" and not fmt.activation_symmetric:
            raise ConfigError(f"{where}: {name} has dynamic asymmetric INT8 activations; vllm-ascend's W8A8_DYNAMIC "
                              "is symmetric per token; compile with activation_symmetric = true (or "
                              "activation_scheme = \"static\")")
        if m.input_zero_point is not None and not -128 <= int(m.input_zero_point) <= 127:
            raise ConfigError(f"{where}: {name}'s static zero point {int(m.input_zero_point)} is outside int8, "
                              "which vllm-ascend's input_offset holds; recompile (the int8 pass keeps 0 in the range)")
    for block in sorted({n[: -len(s)] for n in int8 for g in FUSED_SETS for s in g if n.endswith("." + s)}):
        for group in FUSED_SETS:
            members = [loaded.model.get_submodule(block + s) if _has(loaded.model, block + s) else None for s in group]
            if any(m is None for m in members):
                continue
            kinds = [quant_type(m) if isinstance(m, Int8Linear) else FLOAT for m in members]
            short = "/".join(s.rpartition(".")[2] for s in group)
            if len(set(kinds)) > 1:
                raise ConfigError(f"{where}: {block.rstrip('.')}'s {short} are {', '.join(kinds)}; vllm-ascend runs "
                                  "them as one fused layer of one type; recompile so they match (modules_to_not_convert "
                                  "naming all of them, or none)")
            if kinds[0] == W8A8:
                qparams = {(float(m.input_scale), 0 if m.input_zero_point is None else int(m.input_zero_point))
                           for m in members}
                if len(qparams) > 1:
                    raise ConfigError(f"{where}: {block.rstrip('.')}'s {short} have different static input scales / "
                                      f"zero points {sorted(qparams)}; vllm-ascend keeps one for the fused layer; "
                                      "use activation_scheme = \"dynamic\"")


def c8_refusal(kv_cache: dict | None, head_dim: int | None) -> str | None:
    """Why vllm-ascend's C8 cannot hold a KV-cache entry (its ``dtype`` read), or None."""
    if not kv_cache:
        return None
    if kv_cache.get("dtype") != INT8:
        return (f"a KV cache ({kv_cache.get('dtype')}): AscendV1's one KV cache is vllm-ascend's INT8 'C8'; compile "
                "with the int8 pass's kv_cache_dtype = \"int8\", or without kv_cache_dtype")
    if head_dim is not None and head_dim % C8_BLOCK:
        return (f"an INT8 KV cache with head_dim {head_dim}: vllm-ascend's C8 cache holds K/V in blocks of "
                f"{C8_BLOCK} channels, so head_dim must be a multiple of {C8_BLOCK}; compile without kv_cache_dtype")
    return None


def serving_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the directory is written in: the model's when half precision, else bfloat16 (vllm-ascend's
    INT8 matmuls return float16 or bfloat16, and W8A8 has no float32 deq_scale)."""
    dtype = model.embed_tokens.weight.dtype
    return dtype if str(dtype).removeprefix("torch.") in HALF_DTYPES else torch.bfloat16


def _has(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def deqscale2int64(scale: torch.Tensor) -> torch.Tensor:
    """msModelSlim's packing of a float32 deq_scale for float16 models: its bits as int32, widened to int64."""
    bits = np.frombuffer(scale.detach().cpu().to(torch.float32).numpy().tobytes(), dtype=np.int32)
    return torch.from_numpy(bits.astype(np.int64))


def int64_to_deqscale(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``deqscale2int64`` (the low 32 bits as float32)."""
    return torch.from_numpy(packed.cpu().numpy().astype(np.int32).view(np.float32).copy())


@dataclass
class _Rounding:
    """The largest relative change of each kind of value written in the model dtype."""

    worst: dict[str, float] = field(default_factory=dict)
    bias_steps: float = 0.0  # the largest |folded bias - bias| / deq_scale (≤ 0.5)
    bias_abs: float = 0.0
    odd_zero_point: bool = False
    static_symmetric: bool = False

    def cast(self, kind: str, value: torch.Tensor, dtype: torch.dtype, effective: torch.Tensor | None = None
             ) -> torch.Tensor:
        """``value`` in ``dtype``, recording how far ``effective`` (default: that) is from it."""
        out = value.to(dtype)
        ref = value.float()
        got = out.float() if effective is None else effective.float()
        change = ((got - ref).abs() / ref.abs().clamp(min=torch.finfo(torch.float32).tiny)).max()
        self.worst[kind] = max(self.worst.get(kind, 0.0), float(change) if value.numel() else 0.0)
        return out

    def notes(self, dtype: str) -> list[str]:
        out = [f"vllm-ascend holds {kind} in {dtype}: rounding the artifact's float32 ones changes them by up to "
               f"{w:.1e} (relative)" for kind, w in sorted(self.worst.items()) if w > 0]
        if self.static_symmetric:
            out.append("W8A8 (static, symmetric): npu_quantize clamps codes to -128..127, the artifact to -127..127: "
                       "an input below -127.5 input scales quantizes one step lower")
        if self.odd_zero_point:
            out.append("W8A8 (static, zero point): npu_quantize rounds x / s + z at once, the artifact rounds x / s "
                       "then adds z: with an odd z, codes differ by one where x / s is exactly half-way")
        if self.bias_steps > 0:
            out.append(f"W8A8 (static) folds each float bias into quant_bias (msModelSlim's round(bias / deq_scale)): "
                       f"off by up to {self.bias_steps:.2f} of a deq_scale step ({self.bias_abs:.1e})")
        return out


def layer_tensors(module: Int8Linear, dtype: torch.dtype, rounding: _Rounding | None = None) -> dict[str, torch.Tensor]:
    """The AscendV1 tensors of one Int8Linear (suffix -> tensor), in vllm-ascend's parameter dtypes."""
    rounding = rounding or _Rounding()
    kind = quant_type(module)
    n = module.out_features
    scale = module.weight_scale.detach().float().reshape(n, 1)
    out = {"weight": module.weight.detach().to(torch.int8).contiguous(),
           "weight_scale": rounding.cast("INT8 weight scales", scale, dtype).contiguous(),
           "weight_offset": torch.zeros(n, 1, dtype=dtype)}
    if kind == W8A8:
        input_scale = rounding.cast("static input scales", module.input_scale.detach().float().reshape(1), dtype)
        # vllm-ascend quantizes by the reciprocal, computed in the model dtype: 1 / (1 / s').to(dt)
        rounding.cast("static input scales (as the reciprocal it quantizes by)",
                      module.input_scale.detach().float().reshape(1), dtype,
                      1 / (1 / input_scale).to(dtype).float())
        zero = 0 if module.input_zero_point is None else int(module.input_zero_point)
        rounding.odd_zero_point |= zero % 2 == 1
        rounding.static_symmetric |= module.input_zero_point is None
        deq = input_scale.float() * module.weight_scale.detach().float()  # float32, as msModelSlim computes it
        correction = module.weight.to(torch.float32).sum(dim=1) * float(zero)
        bias = torch.zeros(n) if module.bias is None else module.bias.detach().float()
        quant_bias = torch.round(bias / deq - correction)
        if quant_bias.abs().max() > torch.iinfo(torch.int32).max:
            raise ConfigError(f"a static W8A8 layer's bias / deq_scale exceeds int32 (deq_scale down to "
                              f"{float(deq.min()):.1e}); recompile with activation_scheme = \"dynamic\"")
        if module.bias is not None:
            folded = (quant_bias + correction) * deq
            rounding.bias_abs = max(rounding.bias_abs, float((folded - bias).abs().max()))
            rounding.bias_steps = max(rounding.bias_steps, float(((folded - bias).abs() / deq).max()))
        out |= {"input_scale": input_scale.contiguous(),
                "input_offset": torch.tensor([zero], dtype=torch.int8),
                "deq_scale": deq.contiguous() if dtype == torch.bfloat16 else deqscale2int64(deq),
                "quant_bias": quant_bias.to(torch.int32).contiguous()}
    if module.bias is not None:
        out["bias"] = module.bias.detach().to(dtype).contiguous()
    return out


def ascend_v1_tensors(loaded: LoadedModel) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(tensors by HF name, the description, notes) of a checked artifact."""
    model = loaded.model
    dtype = serving_dtype(model)
    quantized = quantized_modules(model)
    rounding = _Rounding()
    tensors: dict[str, torch.Tensor] = {}
    description: dict = {}
    kinds = {FLOAT}
    for name, module in quantized.items():
        kind = quant_type(module)
        kinds.add(kind)
        for suffix, t in layer_tensors(module, dtype, rounding).items():
            tensors[f"{hf_name(name)}.{suffix}"] = t
            description[f"{hf_name(name)}.{suffix}"] = FLOAT if suffix == "bias" else kind
    tied = model.config.tie_embeddings
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in quantized:
            continue
        if name == "lm_head.weight" and tied:  # vLLM skips it; vllm-ascend still looks its type up
            description["lm_head.weight"] = FLOAT
            continue
        if t.is_floating_point() and t.dtype != dtype:
            t = rounding.cast("float tensors (embeddings, norms, float layers)", t.detach(), dtype)
        tensors[f"{hf_name(module)}.{leaf}"] = t.detach().contiguous()
        description[f"{hf_name(module)}.{leaf}"] = FLOAT
    header = {"version": VERSION, "model_quant_type": max(kinds, key=PRIORITY.index), "metadata": {}, "group_size": 0,
              "optional": {}}
    c8 = c8_tensors(model, dtype, rounding)
    if c8:
        tensors |= c8
        description |= dict.fromkeys(c8, C8)
        header |= {"kv_cache_type": C8, "kv_quant_type": C8}  # msModelSlim writes both; vllm-ascend reads the first
    return tensors, header | dict(sorted(description.items())), rounding.notes(str(dtype).removeprefix("torch."))


def c8_tensors(model: torch.nn.Module, dtype: torch.dtype, rounding: _Rounding) -> dict[str, torch.Tensor]:
    """vllm-ascend's C8 tensors (HF name -> tensor) of the model's INT8 K/V rounding (none without one)."""
    out = {}
    for i, layer in enumerate(model.layers):
        quant = layer.self_attn.kv_quant
        if not isinstance(quant, Int8KVQuant):
            return {}
        for proj, scale in (("k_proj", quant.k_scale), ("v_proj", quant.v_scale)):
            prefix = hf_name(f"layers.{i}.self_attn.{proj}")
            written = rounding.cast("C8 KV-cache scales", scale.detach(), dtype)
            # vllm-ascend quantizes by the reciprocal, computed in the model dtype: 1 / (1 / s').to(dt)
            rounding.cast("C8 KV-cache scales (as the reciprocal it quantizes by)", scale.detach(), dtype,
                          1 / (1 / written).to(dtype).float())
            out[f"{prefix}.kv_cache_scale"] = written.contiguous()
            out[f"{prefix}.kv_cache_offset"] = torch.zeros(scale.numel(), dtype=dtype)
    return out


def write_weights(directory: Path, tensors: dict[str, torch.Tensor], part_bytes: int = PART_BYTES) -> list[str]:
    """``quant_model_weights.safetensors``, or msModelSlim's numbered parts and their index."""
    from backends.vllm.export import write_shards

    return write_shards(directory, tensors, part_bytes, WEIGHTS_PREFIX)


@dataclass
class AscendV1Export:
    """Everything the directory holds, built (and checked) before anything is written."""

    tensors: dict[str, torch.Tensor]
    description: dict
    config: dict
    tokenizer: object
    notes: list[str]

    def write(self, directory: Path, part_bytes: int = PART_BYTES) -> list[str]:
        """Write the directory (which must not exist); returns the weight files."""
        directory.mkdir(parents=True)
        files = write_weights(directory, self.tensors, part_bytes)
        (directory / DESCRIPTION_FILE).write_text(json.dumps(self.description, indent=2))
        (directory / "config.json").write_text(json.dumps(self.config, indent=2))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))
        return files


def prepare_ascend_v1(loaded: LoadedModel) -> AscendV1Export:
    """The AscendV1 export of a checked artifact (``check_ascend_v1``), its notes included."""
    from backends.vllm.export import hf_config

    tensors, description, notes = ascend_v1_tensors(loaded)
    dtype = str(serving_dtype(loaded.model)).removeprefix("torch.")
    if loaded.model.embed_tokens.weight.dtype != serving_dtype(loaded.model):
        notes.insert(0, f"written in {dtype}, as vllm-ascend runs INT8 layers (the artifact is "
                        f"{str(loaded.model.embed_tokens.weight.dtype).removeprefix('torch.')}): codes unchanged, "
                        "the float values rounded as below")
    config = hf_config(loaded.model.config, dtype)  # no quantization_config: vllm-ascend finds the description
    if loaded.tokenizer is None:
        notes.append("the artifact holds no tokenizer: give vllm serve --tokenizer")
    return AscendV1Export(tensors, description, config, loaded.tokenizer, notes)


def read_ascend_v1(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the description, every tensor) of a written directory, its parts merged."""
    from safetensors.torch import load_file

    directory = Path(directory)
    description = json.loads((directory / DESCRIPTION_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        if re.fullmatch(rf"{WEIGHTS_PREFIX}(-\d{{5}}-of-\d{{5}})?\.safetensors", path.name):
            tensors |= load_file(str(path))
    return description, tensors
