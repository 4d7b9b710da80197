"""Tiny models for the distillation tests (built directly, no checkpoint files)."""
import copy

import torch

from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import linear_modules
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer


def tiny_model(seed: int = 0, dim: int = 32, n_layers: int = 2, vocab: int = 64, tie: bool = False) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig("LlamaForCausalLM", vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                         intermediate_size=48, tie_embeddings=tie)
    model = Transformer(config)
    if tie:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)  # peaked enough that KL and argmax are not trivial
    return model.eval()


def int4_copy(model: Transformer, group_size: int = 32) -> Transformer:
    """RTN INT4 student: every projection but lm_head as ``Int4Linear``."""
    student = copy.deepcopy(model)
    for name, m in linear_modules(student).items():
        if name != "lm_head":
            student.set_submodule(name, Int4Linear.from_float(m, group_size))
    return student


def random_sequences(n: int = 16, seq_len: int = 16, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a[k] - b[k]| over every tensor of two state dicts. A NaN anywhere gives NaN, which
    fails every bound (Python's ``max()`` over floats keeps a NaN only when it comes first)."""
    return torch.stack([(a[k].double() - b[k].double()).abs().max() for k in a]).max().item()
