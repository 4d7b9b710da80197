"""Shared fixtures: tiny random checkpoints of each architecture, and the real SmolLM2-135M."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

os.environ.setdefault("QCOMPILE_PROGRESS", "0")
HAS_CUDA = torch.cuda.is_available()
# Without a GPU, OpenAI Triton kernels run in its interpreter on CPU tensors; with one they run
# compiled. It must be set before any module decorates a kernel with @triton.jit, so it is set
# here, before the tests import anything.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
KERNEL_DEVICE = "cuda" if HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m: the markers added here count
def pytest_collection_modifyitems(config, items):
    """``pytest -m gpu`` on a GPU host runs, as one step, every test that can exercise the GPU:

    - ``@pytest.mark.gpu`` (optionally ``gpu(capability=(9, 0))``): CUDA-only tests, skipped with
      the reason where no such CUDA device is visible;
    - every test taking ``kernel_device`` (the OpenAI-Triton kernel tests) gets the marker here.
      Those run compiled on a GPU and in Triton's interpreter elsewhere, so they are not skipped."""
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            if "kernel_device" in item.fixturenames:
                item.add_marker(pytest.mark.gpu)
            continue
        need = tuple(marker.kwargs.get("capability", (0, 0)))
        if not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))
        elif torch.cuda.get_device_capability() < need:
            have = torch.cuda.get_device_capability()
            item.add_marker(pytest.mark.skip(reason=f"needs compute capability {need}, this GPU has {have}"))


@pytest.fixture
def kernel_device() -> str:
    """Where a Triton kernel under test runs: a CUDA GPU when there is one (compiled), else the CPU
    (the interpreter)."""
    return KERNEL_DEVICE


def kernel_levels() -> list[str | None]:
    """The ISA levels of qcompile's C++ CPU kernels that tests run each kernel at: every level this
    CPU runs, or under QCOMPILE_CPU_ISA the one level the process takes (scripts/test_isa_levels.sh
    runs a process per level); [None] where it runs none: the tests then skip, saying why."""
    from compiler.kernels.cpu_isa import active_level, allowed_levels, isa_cap

    levels = [active_level()] if isa_cap() else list(allowed_levels())
    return [level for level in levels if level] or [None]


@contextlib.contextmanager
def kernels_at(level: str | None):
    """``cpu_kernels()`` is ``level``'s inside the block (``use_isa``). A missing build fails the
    test rather than skipping it, so a broken build cannot pass unnoticed; ``QCOMPILE_CPU_KERNELS=0``
    (the kernels turned off on purpose) and a CPU below every level skip it, saying so."""
    from compiler.kernels.cpu_ext import SWITCH, use_isa
    from compiler.kernels.cpu_isa import no_level_reason

    if os.environ.get(SWITCH, "1") == "0":
        pytest.skip(f"C++ CPU kernels turned off by {SWITCH}=0")
    if level is None:
        pytest.skip(no_level_reason())
    with use_isa(level):
        yield


@pytest.fixture(params=kernel_levels())
def isa(request):
    """Each ISA level in turn (``kernel_levels``), the test's kernels that level's: a test taking it
    checks every level the host can run, not just its best."""
    with kernels_at(request.param):
        yield request.param


@pytest.fixture
def cpu_ops(isa):
    """The C++ CPU kernels' op namespace at each level of ``isa``."""
    from compiler.kernels.cpu_ext import cpu_kernels

    return cpu_kernels()


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model of ``arch`` (the reference for parity tests)."""
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    # Random init gives near-uniform logits; larger weights make argmax decisions clear-cut.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory: save a tiny HF checkpoint of ``arch`` and return (path, transformers model)."""

    def make(arch: str = "llama", **overrides):
        model = make_hf_model(arch, **overrides)
        path = tmp_path / f"tiny-{arch}"
        model.save_pretrained(path)
        return path, model

    return make


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (GGUF Q4_1 dequantized to float32), loaded once per session."""
    from compiler.io.load import load_checkpoint

    return load_checkpoint("smollm2")


def make_byte_tokenizer(vocab_size: int = 320):
    """A small byte-level BPE tokenizer trained on the pydoc corpus (no download), ids < vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from calib import load_corpus_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([load_corpus_text("pydoc")[:200_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()


@pytest.fixture
def tiny_checkpoint_with_tokenizer(tmp_path, byte_tokenizer):
    """Factory: a tiny HF checkpoint whose vocabulary matches ``byte_tokenizer`` (saved beside it)."""

    def make(arch: str = "llama", **overrides):
        overrides.setdefault("vocab_size", len(byte_tokenizer))
        model = make_hf_model(arch, **overrides)
        path = tmp_path / f"tiny-{arch}-tok"
        model.save_pretrained(path)
        byte_tokenizer.save_pretrained(path)
        return path, model

    return make
