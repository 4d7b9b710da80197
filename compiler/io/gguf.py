"""Read a llama.cpp GGUF file into our config and float tensors (dequantized tensor by tensor).

Per GGUF architecture: the HF architecture it is, whether llama.cpp permuted the q/k rows for
its RoPE layout (undone here), how its tensors are named, and what llama.cpp changed in them
(Gemma's norm weights are stored as 1 + w; the w is restored; a MoE layer's experts are stacked
into one ``ffn_*_exps`` tensor each, split here into one Linear per expert), as transformers
reads them (``transformers/modeling_gguf_pytorch_utils.py``).

The architectures are those transformers reads that the decoder supports: llama, qwen2, qwen3,
qwen3moe, gemma3. The rest stop with one line naming the architecture, among them a ``llama``
file with experts (llama.cpp's Mixtral: transformers reads it as a dense Llama without its
experts) and ``deepseek2`` (DeepSeek-V2/V3, which transformers does not read). Where transformers
falls back to a config default for a key the file holds (qwen3's ``attention.key_length``,
qwen3moe's ``expert_feed_forward_length``), the file's key is read, as llama.cpp reads it.

``read_gguf`` reads every tensor through ``GGUFReader``'s memory map (a whole-model load).
A streamed compile reads a few at a time instead: ``gguf_index`` keeps where each tensor's bytes
are and lets the map go, and ``read_gguf_tensor`` copies one stored tensor's bytes out of the
file, so only the tensors handed out stay resident. Both convert through ``_model_tensors``, so
they give the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import torch

from compiler.errors import CheckpointError
from compiler.model.architectures import FULL, SLIDING
from compiler.model.config import ModelConfig

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QWEN3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_QWEN3MOE_LAYER_TENSORS = {**_QWEN3_LAYER_TENSORS, "ffn_gate_inp": "mlp.gate"}
# llama.cpp stacks a layer's experts into one tensor per projection: [num_experts, out, in].
_QWEN3MOE_EXPERT_TENSORS = {"ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
                            "ffn_down_exps": "mlp.experts.{}.down_proj"}
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


@dataclass(frozen=True)
class GgufArch:
    architecture: str  # the HF architecture
    permuted_qk: bool = False  # llama.cpp interleaved q/k rows for its RoPE
    layer_tensors: dict[str, str] = field(default_factory=lambda: _LAYER_TENSORS)
    norm_offset: float = 0.0  # stored norm weights = offset + w (Gemma)
    # Stacked expert tensors: GGUF name -> the HF module of expert {} (empty: a dense model).
    expert_tensors: dict[str, str] = field(default_factory=dict)


GGUF_ARCHITECTURES = {
    "llama": GgufArch("LlamaForCausalLM", permuted_qk=True),
    "qwen2": GgufArch("Qwen2ForCausalLM"),
    "qwen3": GgufArch("Qwen3ForCausalLM", layer_tensors=_QWEN3_LAYER_TENSORS),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", layer_tensors=_QWEN3MOE_LAYER_TENSORS,
                         expert_tensors=_QWEN3MOE_EXPERT_TENSORS),
    "gemma3": GgufArch("Gemma3ForCausalLM", layer_tensors=_GEMMA3_LAYER_TENSORS, norm_offset=1.0),
}


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); re-download or re-convert it") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gemma3_fields(reader, n_layers: int) -> dict[str, Any]:
    """What transformers assumes for a Gemma 3 GGUF (its Gemma3TextConfig defaults where the file is silent)."""
    window = _field(reader, "gemma3.attention.sliding_window")
    return dict(layer_types=[SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)],
                sliding_window=int(window) if window else 4096, rope_local_theta=10_000.0,
                query_pre_attn_scalar=256.0)


def _experts(reader, arch: str) -> int:
    """How many experts the file's layers route to: its ``expert_count``, else its stacked expert tensors."""
    stacked = [t for t in reader.tensors if t.name.endswith("_exps.weight")]
    # ``t.shape`` lists GGUF's dimensions innermost first: the expert axis is the last one.
    return int(_field(reader, f"{arch}.expert_count") or (stacked[0].shape[-1] if stacked else 0))


def _refuse(reader, path: Path, arch: str) -> None:
    """What the loader cannot read as transformers does: one line naming it."""
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {supported} "
                              "(load other architectures from HF safetensors)")
    experts = _experts(reader, arch)
    if experts and not GGUF_ARCHITECTURES[arch].expert_tensors:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} with {experts} experts (llama.cpp's "
                              "Mixtral) is not supported: transformers reads it as a dense model without its experts; "
                              "load the HF safetensors checkpoint")
    # transformers reads no RoPE scaling from GGUF metadata (llama.cpp applies it): neither can match both.
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{path}: {arch} GGUF with rope scaling {scaling!r} is not supported")


def _moe_fields(reader, arch: str) -> dict[str, Any]:
    """Qwen3-MoE as llama.cpp runs it: every layer routed, top-k weights renormalised (transformers
    sets norm_topk_prob for these files too); the expert width from the file, else its tensors."""
    gates = [t for t in reader.tensors if t.name.endswith("ffn_gate_exps.weight")]
    # No width and no expert tensors: 0, which ModelConfig refuses in one line.
    width = _field(reader, f"{arch}.expert_feed_forward_length") or (gates[0].shape[1] if gates else 0)
    return dict(num_experts=_experts(reader, arch), num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0)),
                moe_intermediate_size=int(width), norm_topk_prob=True)


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    _refuse(reader, path, arch)
    names = {t.name for t in reader.tensors}
    n_heads = _field(reader, f"{arch}.attention.head_count")
    dim = _field(reader, f"{arch}.embedding_length")
    n_layers = int(_field(reader, f"{arch}.block_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if not vocab:
        raise CheckpointError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens; the file is incomplete")
    extra = {}
    if arch == "gemma3":
        extra = _gemma3_fields(reader, n_layers)
    elif GGUF_ARCHITECTURES[arch].expert_tensors:
        extra = _moe_fields(reader, arch)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch].architecture,
        vocab_size=int(vocab),
        dim=int(dim),
        n_layers=n_layers,
        n_heads=int(n_heads),
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", dim // n_heads)),
        norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        **extra,
    )


def _hf_name(gguf_name: str, layer_tensors: dict[str, str]) -> str | None:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_tensors:
        return f"layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_experts(gguf_name: str, w: np.ndarray, expert_tensors: dict[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """One stacked ``blk.N.ffn_*_exps.weight`` ([num_experts, out, in]) as each expert's weight."""
    _, layer, kind, suffix = gguf_name.split(".")
    module = expert_tensors[kind]
    for e in range(w.shape[0]):
        yield f"layers.{layer}.{module.format(e)}.{suffix}", w[e]


def _is_stacked(gguf_name: str, expert_tensors: dict[str, str]) -> bool:
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in expert_tensors


def _model_tensors(data: np.ndarray, tensor_type, gguf_name: str, config: ModelConfig, arch: GgufArch,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """One stored tensor (``data``: its bytes as the reader types them) as our model's tensors:
    one, or one per expert for a stacked experts tensor."""
    from gguf.quants import dequantize

    w = dequantize(data, tensor_type)
    if _is_stacked(gguf_name, arch.expert_tensors):
        for name, expert in _split_experts(gguf_name, w, arch.expert_tensors):
            yield name, torch.from_numpy(np.array(expert, copy=True)).to(dtype)  # its own memory, not the stack's
        return
    name = _hf_name(gguf_name, arch.layer_tensors)
    if arch.permuted_qk and name.endswith("q_proj.weight"):
        w = _unpermute(w, config.n_heads)
    elif arch.permuted_qk and name.endswith("k_proj.weight"):
        w = _unpermute(w, config.n_kv_heads)
    if arch.norm_offset and "norm.weight" in gguf_name:
        w = w - np.float32(arch.norm_offset)
    # A float32 tensor comes back as a view of the reader's read-only map: copied, as a tensor must
    # own writable memory. Dequantized ones (and a streamed read's own buffer) are used as they are,
    # which spares a copy of each tensor at the peak.
    yield name, torch.from_numpy(np.array(w, copy=not w.flags.writeable)).to(dtype)


def _is_model_tensor(gguf_name: str, arch: GgufArch) -> bool:
    return _is_stacked(gguf_name, arch.expert_tensors) or _hf_name(gguf_name, arch.layer_tensors) is not None


def iter_gguf_tensors(reader, config: ModelConfig, arch_key: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    arch = GGUF_ARCHITECTURES[arch_key]
    for t in reader.tensors:
        if _is_model_tensor(t.name, arch):
            yield from _model_tensors(t.data, t.tensor_type, t.name, config, arch, dtype)


@dataclass(frozen=True)
class GgufTensor:
    """Where one stored tensor's bytes are in a GGUF file, and how the reader types them."""

    offset: int
    nbytes: int
    dtype: np.dtype  # the element type the reader views the bytes as (uint8 for quantized blocks)
    shape: tuple[int, ...]  # the reader's shape of those elements
    tensor_type: Any  # gguf.GGMLQuantizationType


@dataclass(frozen=True)
class GgufIndex:
    """A GGUF file's config and its stored tensors, with no mapping of the file kept open."""

    config: ModelConfig
    arch: GgufArch
    stored: dict[str, GgufTensor]  # by GGUF name
    names: dict[str, str]  # each of our tensor names -> the GGUF tensor holding it (a stack holds many)


def gguf_index(path: Path) -> GgufIndex:
    """Read the header of GGUF ``path``: its config and where each tensor is (no tensor is read)."""
    reader = _reader(path)
    config = gguf_config(reader, path)
    arch = GGUF_ARCHITECTURES[_field(reader, "general.architecture")]
    stored, names = {}, {}
    for t in reader.tensors:
        if not _is_model_tensor(t.name, arch):
            continue
        stored[t.name] = GgufTensor(t.data_offset, t.data.nbytes, t.data.dtype, tuple(t.data.shape), t.tensor_type)
        if _is_stacked(t.name, arch.expert_tensors):  # the experts' names; slicing the map reads nothing
            names.update((name, t.name) for name, _ in _split_experts(t.name, t.data, arch.expert_tensors))
        else:
            names[_hf_name(t.name, arch.layer_tensors)] = t.name
    return GgufIndex(config, arch, stored, names)  # the reader, and its map of the file, go here


def read_gguf_tensor(f: BinaryIO, index: GgufIndex, gguf_name: str, dtype: torch.dtype,
                     where: Path) -> dict[str, torch.Tensor]:
    """Our tensors from stored tensor ``gguf_name`` of the indexed GGUF file open as ``f``, read
    into memory of their own and converted as ``read_gguf`` converts them."""
    entry = index.stored[gguf_name]
    data = np.empty(entry.nbytes, dtype=np.uint8)
    f.seek(entry.offset)
    if f.readinto(memoryview(data)) != entry.nbytes:
        raise CheckpointError(f"{where}: tensor {gguf_name} ends past the end of the file; the file is truncated")
    try:
        return dict(_model_tensors(data.view(entry.dtype).reshape(entry.shape), entry.tensor_type, gguf_name,
                                   index.config, index.arch, dtype))
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{where}: tensor {gguf_name} could not be read ({e}); the file is corrupt") from None


def read_gguf_config(path: Path) -> ModelConfig:
    """The config of a GGUF file (its metadata; the tensors are not dequantized)."""
    return gguf_config(_reader(path), path)


def read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = _reader(path)
    config = gguf_config(reader, path)
    arch_key = _field(reader, "general.architecture")
    try:
        tensors = dict(iter_gguf_tensors(reader, config, arch_key, dtype))
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{path}: a tensor could not be read ({e}); the file is corrupt or truncated") from None
    return config, tensors
