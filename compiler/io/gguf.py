"""Read a llama.cpp GGUF file into our config and float tensors (dequantized tensor by tensor).

Per GGUF architecture: the HF architecture it is, whether llama.cpp permuted the q/k rows for
its RoPE layout (undone here), how its tensors are named, and what llama.cpp changed in them
(Gemma's norm weights are stored as 1 + w; the w is restored), as transformers reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

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
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


@dataclass(frozen=True)
class GgufArch:
    architecture: str  # the HF architecture
    permuted_qk: bool = False  # llama.cpp interleaved q/k rows for its RoPE
    layer_tensors: dict[str, str] = field(default_factory=lambda: _LAYER_TENSORS)
    norm_offset: float = 0.0  # stored norm weights = offset + w (Gemma)


GGUF_ARCHITECTURES = {
    "llama": GgufArch("LlamaForCausalLM", permuted_qk=True),
    "qwen2": GgufArch("Qwen2ForCausalLM"),
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


def _gemma3_fields(reader, path: Path, n_layers: int) -> dict[str, Any]:
    """What transformers assumes for a Gemma 3 GGUF (its Gemma3TextConfig defaults where the file is silent)."""
    scaling = _field(reader, "gemma3.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{path}: Gemma 3 GGUF with rope scaling {scaling!r} is not supported")
    window = _field(reader, "gemma3.attention.sliding_window")
    return dict(layer_types=[SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)],
                sliding_window=int(window) if window else 4096, rope_local_theta=10_000.0,
                query_pre_attn_scalar=256.0)


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {supported}")
    names = {t.name for t in reader.tensors}
    n_heads = _field(reader, f"{arch}.attention.head_count")
    dim = _field(reader, f"{arch}.embedding_length")
    n_layers = int(_field(reader, f"{arch}.block_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if not vocab:
        raise CheckpointError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens; the file is incomplete")
    extra = _gemma3_fields(reader, path, n_layers) if arch == "gemma3" else {}
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


def iter_gguf_tensors(reader, config: ModelConfig, arch_key: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    arch = GGUF_ARCHITECTURES[arch_key]
    for t in reader.tensors:
        name = _hf_name(t.name, arch.layer_tensors)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        if arch.permuted_qk and name.endswith("q_proj.weight"):
            w = _unpermute(w, config.n_heads)
        elif arch.permuted_qk and name.endswith("k_proj.weight"):
            w = _unpermute(w, config.n_kv_heads)
        if arch.norm_offset and "norm.weight" in t.name:
            w = w - np.float32(arch.norm_offset)
        yield name, torch.from_numpy(np.array(w, copy=True)).to(dtype)  # copy: the reader maps the file read-only


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
