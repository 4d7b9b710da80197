"""Read a llama.cpp GGUF file into our config and float tensors (dequantized tensor by tensor)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from compiler.errors import CheckpointError
from compiler.model.config import ModelConfig

# GGUF architecture -> (HF architecture, whether llama.cpp permuted q/k rows for its RoPE layout)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); re-download or re-convert it") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {supported}")
    names = {t.name for t in reader.tensors}
    n_heads = _field(reader, f"{arch}.attention.head_count")
    dim = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch][0],
        vocab_size=int(vocab),
        dim=int(dim),
        n_layers=int(_field(reader, f"{arch}.block_count")),
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
    )


def _hf_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
        return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader, config: ModelConfig, arch_key: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    permuted = GGUF_ARCHITECTURES[arch_key][1]
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        if permuted and name.endswith("q_proj.weight"):
            w = _unpermute(w, config.n_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = _unpermute(w, config.n_kv_heads)
        yield name, torch.from_numpy(np.array(w, copy=True)).to(dtype)  # copy: the reader maps the file read-only


def read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = _reader(path)
    config = gguf_config(reader, path)
    arch_key = _field(reader, "general.architecture")
    try:
        tensors = dict(iter_gguf_tensors(reader, config, arch_key, dtype))
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{path}: a tensor could not be read ({e}); the file is corrupt or truncated") from None
    return config, tensors
