"""Writing an artifact as one GGUF file that llama.cpp runs (``qcompile lower ART --target gguf -o F.gguf``).

Written with the ``gguf`` package (llama.cpp's own writer), as llama.cpp's converter
(``convert_hf_to_gguf.py``) lays a model out: its architecture's metadata, llama.cpp's tensor
names (``gguf.get_tensor_name_map``), Llama's q/k rows permuted for its RoPE, Gemma's norms stored
as 1 + w, a MoE layer's experts stacked into one tensor per projection. The weights:

    gguf (GgufLinear, awq format "gguf:...")  its block type, its codes and fields as they are
    int4, symmetric                           Q4_0: nibble = code, d = the scale (float16): bit-exact
    int4, asymmetric                          Q4_1: d = s, m = -s * z rounded to float16 (the notes
                                              say by how much that moves each layer's weights)
    int4 of group 64 / 128 / 256              the group's scale repeated over its 32-blocks (lossless)
    int8, weight-only (W8A16)                 Q8_0: the codes, d = the row's scale in float16 over each 32-block:
                                              exact for the awq pass's (float16 values), else the notes
                                              say how far each layer's scales move
    float matrices                            F32 / F16 / BF16 (``float_type``; default the artifact's dtype)
    the embedding (and a head tied to it)     float, or Q8_0 by round-to-nearest when asked (``embedding_type``),
                                              as llama.cpp's Q4 files store it; the notes say by how much
    norms, biases, routers                    F32

Anything the file cannot hold exactly is refused before any work (``check_artifact``): FP8
layers, INT8 layers with INT8 activations (W8A8), an input shift or outlier channels, INT4
zero-padded rows, rows 32 does not divide, a KV-cache format, an architecture feature llama.cpp's
model for it does not have. A mix of INT4 and INT8 layers (``average_bits``) is written layer by layer. The tokenizer is the source GGUF's
own metadata when the artifact was compiled from a GGUF file that is still there (llama.cpp's
tokenizer exactly), else the artifact's byte-level BPE tokenizer written as the converter does.
The notes and the artifact's manifest hash go into the file (``qcompile.*`` keys).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compiler.deploy.targets import LowerResult
from compiler.errors import ArtifactError, ConfigError
from compiler.formats.gguf_block import GgufLinear
from compiler.formats.int4 import Int4Linear
from compiler.formats.int8 import Int8Linear
from compiler.io.artifact import ArtifactRecord, check_lowered_entries, load_artifact, read_manifest
from compiler.io.atomic import atomic_file_write
from compiler.model.architectures import FULL, SLIDING
from compiler.model.config import ModelConfig
from compiler.options import option
from compiler.quant.gguf_blocks import BLOCK_TYPES

# qcompile's architecture -> llama.cpp's (Mistral and Mixtral are its "llama").
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
             "Gemma3ForCausalLM": "gemma3"}
FLOAT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
NOTES_KEY = "qcompile.notes"
# The manifest entries passes declared (ArtifactRecord.extras) this lowering reads: the serving plan
# (engine settings; llama.cpp takes its own), checked for what changes the numbers.
LOWERED_ENTRIES = frozenset({"serving"})


@dataclass(frozen=True)
class GgufLowerOptions:
    """Options of ``qcompile lower --target gguf``."""

    float_type: str = option("auto", "gguf: the type of the float matrices (embedding, float layers): f32, f16, bf16, "
                                     "or auto (the artifact's dtype: exact).")

    embedding_type: str = option("float", "gguf: the token embedding (and the head tied to it): float (float_type's), or "
                                          "q8_0, rounded to nearest as llama.cpp stores it in its Q4 files (said in the notes).")

    def __post_init__(self):
        if self.float_type not in ("auto", *FLOAT_TYPES):
            raise ValueError(f"float_type must be auto, {', '.join(FLOAT_TYPES)}; got {self.float_type!r}")
        if self.embedding_type not in ("float", "q8_0"):
            raise ValueError(f"embedding_type must be float or q8_0; got {self.embedding_type!r}")


# ---- what GGUF holds -----------------------------------------------------------------------
def check_module(module: str, fmt: dict) -> str | None:
    """None when the GGUF file holds ``module``'s format exactly, else why not and what to compile instead."""
    name = fmt.get("format")
    if name in ("gguf", "int4") and fmt.get("padded_in_features") != fmt.get("in_features"):
        how = 'group_size_policy = "pad"' if name == "int4" else "zero columns"
        return (f"{name} rows zero-padded to {fmt.get('padded_in_features')} ({how}): a GGUF row holds exactly "
                "in_features weights; use group_size_policy = \"fallback\" or a format whose blocks divide the rows")
    if name == "gguf":
        return None
    if name == "int4":
        group = fmt.get("group_size", 0)
        return None if group % 32 == 0 else f"int4 group size {group}: GGUF blocks are 32 wide; use 32, 64, 128 or 256"
    if name == "fp8":
        return "fp8 weights: no GGUF block type holds FP8 codes and scales; compile with the awq pass (format = \"gguf:q4_k_m\" or \"int4\")"
    if name == "int8" and fmt.get("activation_scheme") != "none":
        return (f"int8 weights with {fmt.get('activation_scheme')} INT8 activations (W8A8): llama.cpp quantizes a Q8_0 "
                "layer's activations its own way (per 32 values); compile with activation_scheme = \"none\" (W8A16)")
    if name == "int8":
        k = fmt.get("in_features", 0)
        return None if k % 32 == 0 else f"int8 rows of {k} weights: Q8_0 blocks are 32 wide; keep the layer in float"
    return f"weight format {name!r}, which GGUF cannot hold; compile with the awq pass (format = \"gguf:q4_k_m\")"


def check_config(config: ModelConfig) -> str | None:
    """Why llama.cpp's model of this architecture would not compute what the artifact does (None: it would)."""
    arch = config.architecture
    if arch not in GGUF_ARCH:
        return f"architecture {arch}: llama.cpp has no model qcompile writes it for; supported: {', '.join(GGUF_ARCH)}"
    if config.rope_scaling:
        return f"RoPE scaling {config.rope_scaling}: the GGUF writer does not carry RoPE scaling yet"
    if GGUF_ARCH[arch] == "llama" and config.sliding_window and config.sliding_window < config.max_seq_len:
        return f"a {config.sliding_window}-token sliding window: llama.cpp's llama model attends to the whole context"
    if config.o_bias or config.mlp_bias or (config.qkv_bias and arch != "Qwen2ForCausalLM"):
        return "attention or MLP biases beyond Qwen2's q/k/v ones: llama.cpp's model for it has none"
    if arch == "Gemma3ForCausalLM":
        pattern = [SLIDING if (i + 1) % 6 else FULL for i in range(config.n_layers)]
        if config.layer_types != pattern:
            return "Gemma 3 with a sliding/full layer pattern other than llama.cpp's (every 6th layer full)"
        if config.query_pre_attn_scalar != config.head_dim:
            return f"Gemma 3 with query_pre_attn_scalar {config.query_pre_attn_scalar} != head_dim {config.head_dim}"
        if (config.rope_local_theta or 10_000.0) != 10_000.0 or config.final_logit_softcapping:
            return "Gemma 3 with a local RoPE base other than 10000 or a final logit softcap: llama.cpp fixes both"
    return None


def check_artifact(record: ArtifactRecord, where: str) -> None:
    """Raise ConfigError, before any work, for anything in the artifact a GGUF file cannot hold exactly
    (a KV cache with scales says so before the generic refusal of an entry the lowering does not take)."""
    from compiler.deploy.targets import DeploymentPlan, check_formats, check_plan

    check_formats("gguf", record.modules, where)
    check_plan("gguf", DeploymentPlan(record.dtype_name, record.modules, kv_cache=record.kv_cache, config=record.config,
                                      serving=record.serving), where)
    check_lowered_entries(record, "gguf", LOWERED_ENTRIES, where)


def check_plan(plan) -> str | None:
    if plan.config is not None and (why := check_config(plan.config)):
        return why
    kv = (plan.serving or {}).get("kv_dtype")
    if kv and kv not in ("auto", plan.dtype, "float16", "bfloat16"):  # llama.cpp's f16 / bf16 caches, chosen when served
        return (f"a serving plan that stores K/V as {kv}: llama.cpp's caches (--cache-type-k) carry no FP8 scales; "
                "set the paged_kv pass's kv_dtype = \"auto\"")
    from compiler.deploy.targets import planned_kv_cache

    if kv := planned_kv_cache(plan):
        return (f"a KV cache ({kv['dtype']}) with calibrated scales: llama.cpp's KV cache types carry no scales; "
                "compile without kv_cache_dtype")
    return None


# ---- tensors -------------------------------------------------------------------------------
def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for llama (rotate-half halves -> interleaved RoPE pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class Stored:
    """One tensor as the file stores it: ``data`` (float, or block bytes [rows, row bytes]) and its GGML type."""

    data: np.ndarray
    qtype: str  # "F32", "Q4_K", ...


def _int4_as_blocks(m: Int4Linear, notes: list[str], name: str) -> Stored:
    """Q4_0 (symmetric) or Q4_1 (zero points) of an INT4 layer: its codes, its scales over each 32-block."""
    codes, zero = m.codes()
    repeat = m.group_size // 32
    scale = m.scales.float().repeat_interleave(repeat, dim=1)
    d = scale.to(torch.float16)
    if not torch.equal(d.float(), scale):
        raise ConfigError(f"{name}: INT4 scales outside float16 (a bfloat16 artifact's): GGUF blocks store float16 "
                          "scales; compile the model in float32 or float16")
    t = BLOCK_TYPES["q4_1" if m.zero_point else "q4_0"]
    if not m.zero_point:
        return Stored(t.pack(codes, {"d": d}), t.ggml)
    z = zero.float().repeat_interleave(repeat, dim=1)
    exact_m = -scale * z
    fields = {"d": d, "m": exact_m.to(torch.float16)}
    moved = t.dequantize(codes, fields) - (codes.float() - z.repeat_interleave(32, dim=1)) * scale.repeat_interleave(32, dim=1)
    w = m.dequantized_weight().float()
    notes.append(f"{name}: Q4_1's m = -s*z rounded to float16 moves the weights by {float(moved.norm() / w.norm().clamp(min=1e-30)):.2e} "
                 f"relative (largest {float(moved.abs().max()):.2e})")
    return Stored(t.pack(codes, fields), t.ggml)


def _int8_as_q8_0(m: Int8Linear, notes: list[str], name: str) -> Stored:
    """Q8_0 of a W8A16 INT8 layer: its codes (stored + 128), its row's scale as each 32-block's d in float16."""
    t = BLOCK_TYPES["q8_0"]
    scale = m.weight_scale.float()
    d = scale.to(torch.float16)
    moved = float(((d.float() - scale).abs() / scale).max())
    if moved:
        notes.append(f"{name}: Q8_0's d = the row's INT8 scale rounded to float16 moves its weights by up to "
                     f"{moved:.1e} (relative)")
    codes = (m.weight.to(torch.int16) + 128).to(torch.uint8)
    d = d[:, None].expand(-1, m.in_features // t.super).contiguous()
    return Stored(t.pack(codes, {"d": d}), t.ggml)


def _module_tensor(m, name: str, notes: list[str], float_type: str) -> Stored:
    if isinstance(m, GgufLinear):
        return Stored(m.type.pack(m.codes, m.fields()), m.type.ggml)
    if isinstance(m, Int4Linear):
        return _int4_as_blocks(m, notes, name)
    if isinstance(m, Int8Linear):
        return _int8_as_q8_0(m, notes, name)
    return _float(m.weight, float_type)


def _float(t: torch.Tensor, float_type: str) -> Stored:
    a = t.detach().float()
    if float_type == "F16":
        return Stored(a.to(torch.float16).numpy(), "F16")
    if float_type == "BF16":  # numpy has no bfloat16: the bytes, typed by the writer
        return Stored(a.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(a.shape[0], -1), "BF16")
    return Stored(a.numpy(), "F32")


def _rows(stored: Stored, index) -> Stored:
    """Rows ``index`` of a stored matrix (block rows are whole rows of bytes: a permutation is exact)."""
    return Stored(stored.data[index], stored.qtype)


def _q8_0_embedding(weight: torch.Tensor, notes: list[str]) -> Stored:
    """The embedding table in Q8_0 by round-to-nearest (``embedding_type = "q8_0"``), and by how much it moved."""
    t = BLOCK_TYPES["q8_0"]
    w = weight.detach().float()
    if w.shape[1] % t.super:
        raise ConfigError(f"embedding_type q8_0: 32 does not divide the embedding width {w.shape[1]}; use float")
    fields = t.choose(w)
    codes = t.quantize(w, fields)
    moved = float((t.dequantize(codes, fields) - w).norm() / w.norm().clamp(min=1e-30))
    notes.append(f"embed_tokens: Q8_0 by round-to-nearest (embedding_type q8_0), {moved:.2e} of its norm")
    return Stored(t.pack(codes, fields), t.ggml)


def model_tensors(model, config: ModelConfig, float_type: str, notes: list[str], embedding_type: str = "float"):
    """(llama.cpp tensor name, Stored) for every tensor of ``model``, in the converter's layout."""
    import gguf

    arch = GGUF_ARCH[config.architecture]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.n_layers)
    experts: dict[tuple[str, str], list] = {}
    for module_name, module in model.named_modules():
        if module_name == "lm_head" and config.tie_embeddings:
            continue
        is_linear = isinstance(module, (GgufLinear, Int4Linear, Int8Linear, torch.nn.Linear))
        if not is_linear and not any(True for _ in module.parameters(recurse=False)):
            continue
        hf = "model." + module_name if module_name != "lm_head" else module_name
        if ".experts." in module_name:  # stacked below, one tensor per projection and layer
            base, _, leaf = hf.rpartition(".")
            experts.setdefault((base.rpartition(".")[0], leaf), []).append(module)
            continue
        gguf_name = names.get_name(hf)
        if gguf_name is None:
            raise ConfigError(f"{module_name}: llama.cpp's {arch} model has no tensor for it")
        if is_linear:
            yield from _linear_tensors(module, module_name, gguf_name, config, notes, float_type)
        elif module_name == "embed_tokens" and embedding_type == "q8_0":
            yield f"{gguf_name}.weight", _q8_0_embedding(module.weight, notes)
        else:
            yield from _plain_tensors(module, module_name, gguf_name, arch, float_type)
    for (base, leaf), group in experts.items():
        yield _stacked(names, base, leaf, group, notes, float_type)


def _linear_tensors(module, module_name: str, gguf_name: str, config: ModelConfig, notes: list[str], float_type: str):
    """A linear layer's weight (and bias), Llama's q/k rows permuted for llama.cpp's RoPE."""
    stored = _module_tensor(module, module_name, notes, float_type)
    heads = None
    if GGUF_ARCH[config.architecture] == "llama" and module_name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
        heads = config.n_heads if module_name.endswith("q_proj") else config.n_kv_heads
        stored = _rows(stored, _permute(np.arange(stored.data.shape[0]), heads))
    yield f"{gguf_name}.weight", stored
    if getattr(module, "bias", None) is not None:
        bias = module.bias.detach().float().numpy()
        yield f"{gguf_name}.bias", Stored(bias if heads is None else _permute(bias, heads), "F32")


def _plain_tensors(module, module_name: str, gguf_name: str, arch: str, float_type: str):
    """Embeddings and norms: matrices in ``float_type``, vectors in F32 (Gemma's norms as 1 + w)."""
    for leaf, p in module.named_parameters(recurse=False):
        a = p.detach().float()
        if arch == "gemma3" and "norm" in module_name:
            a = a + 1  # llama.cpp's Gemma norms multiply by the stored weight
        yield f"{gguf_name}.{leaf}", _float(a, float_type) if a.dim() == 2 else Stored(a.numpy(), "F32")


def _stacked(names, base: str, leaf: str, group: list, notes: list[str], float_type: str):
    """A layer's experts of one projection as llama.cpp's [experts, out, in] tensor."""
    stored = [_module_tensor(m, f"{base}.{i}.{leaf}", notes, float_type) for i, m in enumerate(group)]
    kinds = {s.qtype for s in stored}
    if len(kinds) > 1:
        raise ConfigError(f"{base}.*.{leaf}: experts in {sorted(kinds)}; llama.cpp stacks a layer's experts into one "
                          "tensor of one type: compile them with one format")
    hf_leaf = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(leaf, leaf)
    gguf_name = names.get_name(f"{base.replace('block_sparse_moe', 'mlp')}.{hf_leaf}")
    if gguf_name is None:
        raise ConfigError(f"{base}.*.{leaf}: llama.cpp has no stacked expert tensor for it")
    return f"{gguf_name}.weight", Stored(np.stack([s.data for s in stored]), stored[0].qtype)


# ---- metadata ------------------------------------------------------------------------------
def write_metadata(w, config: ModelConfig) -> None:
    arch = GGUF_ARCH[config.architecture]
    w.add_block_count(config.n_layers)
    w.add_context_length(config.max_seq_len)
    w.add_embedding_length(config.dim)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_vocab_size(config.vocab_size)
    if config.num_experts:
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gemma3":
        w.add_sliding_window(config.sliding_window)


def write_tokenizer(w, record: ArtifactRecord, tokenizer, vocab_size: int) -> str:
    """The tokenizer's metadata; returns where it came from."""
    source = record.source
    if source.kind == "gguf" and Path(source.path).is_file():
        from compiler.io.types import sha256_files

        path = Path(source.path)
        if sha256_files([path]) == source.sha256:
            _copy_tokenizer(w, path)
            return f"the tokenizer: the source GGUF's own ({path.name})"
    if tokenizer is None:
        raise ConfigError("the artifact has no tokenizer; llama.cpp needs one in the file: compile from a checkpoint with tokenizer files")
    beyond = _byte_level_bpe(w, tokenizer, vocab_size)
    dropped = f"; its tokens {beyond} have ids past the model's {vocab_size} embeddings and are left out" if beyond else ""
    return f"the tokenizer: the artifact's byte-level BPE, written as llama.cpp's converter writes one{dropped}"


def _copy_tokenizer(w, path: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, value, vtype, sub_type=sub)


# llama.cpp's pre-tokenizer names by the split regex of the tokenizer's ByteLevel/Split pre-tokenizer.
_PRE_BY_REGEX = {
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+": "gpt-2",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
}
_GPT2_REGEX = next(iter(_PRE_BY_REGEX))


def _pre_tokenizer(spec: dict | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json ``pre_tokenizer`` (ConfigError if none fits)."""
    steps = (spec or {}).get("pretokenizers", [spec] if spec else [])
    regexes = []
    for step in steps:
        if step.get("type") == "Split":
            regexes.append(step["pattern"].get("Regex"))
        elif step.get("type") == "ByteLevel" and step.get("use_regex", True):
            regexes.append(_GPT2_REGEX)
        elif step.get("type") == "Digits" and step.get("individual_digits"):
            regexes.append("digits")
    if regexes == ["digits", _GPT2_REGEX]:
        return "smollm"  # SmolLM's: single digits, then GPT-2's split
    if len(regexes) == 1 and regexes[0] in _PRE_BY_REGEX:
        return _PRE_BY_REGEX[regexes[0]]
    raise ConfigError(f"the tokenizer's pre-tokenizer ({json.dumps(spec)[:120]}) is none that llama.cpp names here; "
                      "compile from the model's GGUF file, whose tokenizer is then copied")


def _byte_level_bpe(w, tokenizer, vocab_size: int) -> list[str]:
    """Write the tokenizer as ``vocab_size`` tokens (the converter's ``[PAD{i}]`` fill where it has
    fewer); returns the tokens whose ids are past the embedding (no id of the model reaches them)."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("decoder")):
        raise ConfigError(f"a {model.get('type')} tokenizer that is not byte-level BPE: write it from its GGUF file "
                          "(compile from the .gguf) — the SentencePiece scores llama.cpp needs are not in tokenizer.json")
    vocab = dict(model["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    beyond = sorted(t for i, t in by_id.items() if i >= vocab_size)
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer(spec.get("pre_tokenizer")))
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.USER_DEFINED if i not in by_id
                       else gguf.TokenType.NORMAL for i, t in enumerate(tokens)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    for what, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                           ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None and token_id < vocab_size:
            getattr(w, {"bos": "add_bos_token_id", "eos": "add_eos_token_id", "unk": "add_unk_token_id",
                        "pad": "add_pad_token_id"}[what])(token_id)
    w.add_add_bos_token(False)
    if getattr(tokenizer, "chat_template", None):
        w.add_chat_template(tokenizer.chat_template)
    return beyond


# ---- the file ------------------------------------------------------------------------------
def export_gguf(artifact: Path, out: Path, opts: GgufLowerOptions, force: bool) -> LowerResult:
    """Write ``artifact`` as the GGUF file ``out`` (atomically); its notes are in the file too (``file_notes``)."""
    import gguf

    if out.exists() and not force:
        raise ArtifactError(f"{out} already exists; choose another -o or pass --force to replace it")
    record = read_manifest(artifact)
    check_artifact(record, str(artifact))
    loaded = load_artifact(artifact)
    config = loaded.model.config
    float_type = FLOAT_TYPES[opts.float_type] if opts.float_type != "auto" else {
        "float32": "F32", "float16": "F16", "bfloat16": "BF16"}[record.dtype_name]
    notes: list[str] = []
    tensors = list(model_tensors(loaded.model, config, float_type, notes, opts.embedding_type))

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), GGUF_ARCH[config.architecture])
        w.add_name(Path(record.source.path or artifact.name).stem)
        write_metadata(w, config)
        notes.append(write_tokenizer(w, record, loaded.tokenizer, config.vocab_size))
        w.add_array(NOTES_KEY, notes)
        w.add_string("qcompile.artifact_manifest_sha256", record.sha256)
        for name, stored in tensors:
            qtype = gguf.GGMLQuantizationType[stored.qtype]
            if stored.qtype == "F32" or stored.qtype == "F16":
                w.add_tensor(name, stored.data)
            else:
                w.add_tensor(name, stored.data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=True)
        w.close()

    atomic_file_write(out, write, force)
    return LowerResult(out, notes)


def file_notes(path: Path) -> list[str]:
    """The notes a GGUF file written here carries."""
    import gguf

    field = gguf.GGUFReader(path).fields.get(NOTES_KEY)
    return list(field.contents()) if field else []
