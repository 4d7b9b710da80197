"""ONNX export: checker, opset, MatMulNBits straight from packed buffers, parity with torch.

Parity is with the format's exact numerics: the bundles compute MatMulNBits at accuracy_level 0
(float32) and the torch side runs ``Int4Linear``'s dequantize reference, not the CPU kernel (its
bfloat16 rounding is bounded in tests/compiler/kernels/test_int4_cpu.py). The default int8
accuracy level is bounded by its own test below."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx_helpers import make_artifact, ragged_rows_error, rel_error

from backends.onnx.bundle import DECODE_FILE, PREFILL_FILE, WEIGHTS_FILE, OnnxBundleInfo
from backends.onnx.export import EXTERNAL_THRESHOLD, OnnxExportOptions, export_onnx
from backends.onnx.runner import OnnxRunner
from compiler.formats.qlinear import QuantizedLinear
from backends.onnx.graph import DEFAULT_ACCURACY_LEVEL
from compiler.errors import ConfigError
from compiler.io.artifact import load_artifact
from compiler.kernels.int4_cpu import reference_only
from compiler.model.kv_cache import ContiguousKVCache

MAX_LEN = 96
CASES = [("llama", None, {}), ("llama", 32, {}), ("qwen2", None, {}), ("qwen2", 64, {}),
         ("mistral", None, {"sliding_window": 8}), ("mistral", 32, {"sliding_window": 8})]


@pytest.fixture(autouse=True)
def int4_reference():
    with reference_only():
        yield


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{'int4g' + str(c[1]) if c[1] else 'float'}")
def lowered(request, tmp_path):
    arch, group, overrides = request.param
    artifact = make_artifact(tmp_path, arch, group, **overrides)
    loaded = load_artifact(artifact)
    out = tmp_path / "onnx"
    export_onnx(loaded, out, OnnxExportOptions(max_len=MAX_LEN, accuracy_level=0))
    return loaded, out


def test_checker_opset_and_external_data(lowered):
    loaded, out = lowered
    for name in (PREFILL_FILE, DECODE_FILE):
        onnx.checker.check_model(str(out / name))
        model = onnx.load(str(out / name), load_external_data=False)
        assert {o.domain: o.version for o in model.opset_import}[""] == 17
        # Every tensor above the threshold lives in the one shared weights.data file.
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                assert len(t.raw_data) <= EXTERNAL_THRESHOLD, t.name
            else:
                assert {e.key: e.value for e in t.external_data}["location"] == WEIGHTS_FILE
    weights = sum(p.numel() * p.element_size() for p in loaded.model.state_dict().values())
    assert (out / WEIGHTS_FILE).stat().st_size > 0.5 * weights


def optimized_ops(path, tmp_path) -> tuple[list[str], dict[str, str], list[str]]:
    """The graph ONNX Runtime runs after its optimizer: op types, producer of each value, output names."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"optimized-{path.name}")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    return ([n.op_type for n in graph.node], {o: n.op_type for n in graph.node for o in n.output},
            [o.name for o in graph.output])


def test_onnx_runtime_fuses_the_norms_and_attention_writes_the_cache(lowered, tmp_path):
    """What keeps the decode step fast in ONNX Runtime: every RMSNorm fuses into one
    SimplifiedLayerNormalization, each layer's attention is one GroupQueryAttention with the rotary
    embedding inside it, and each present cache is that op's own output (bound to the past buffer,
    written in place), at prefill and at decode."""
    loaded, out = lowered
    n_norms, n_layers = 2 * loaded.model.config.n_layers + 1, loaded.model.config.n_layers
    for name in (PREFILL_FILE, DECODE_FILE):
        ops, producers, outputs = optimized_ops(out / name, tmp_path)
        assert ops.count("SimplifiedLayerNormalization") == n_norms and "ReduceMean" not in ops
        assert ops.count("GroupQueryAttention") == n_layers and "RotaryEmbedding" not in ops and "Softmax" not in ops
        assert {producers[o] for o in outputs if o.startswith("present_")} == {"GroupQueryAttention"}
    graph = onnx.load(str(out / DECODE_FILE), load_external_data=False).graph
    assert {i.name for i in graph.input} >= {"input_ids", "past_lens"} and OnnxBundleInfo.read(out).attention == "gqa"


def test_standard_attention_graphs_write_the_cache_once(lowered, tmp_path):
    """--no-fused-attention (standard-op attention over every cache slot, one past_len for the batch):
    the norms fuse, RotaryEmbedding on q and k, and each present cache comes straight from the op that
    writes it (ScatterElements at decode, Pad at prefill), not through a copying Identity or Slice + Concat."""
    loaded, _ = lowered
    out = tmp_path / "standard"
    export_onnx(loaded, out, OnnxExportOptions(max_len=MAX_LEN, accuracy_level=0, fused_attention=False))
    n_norms = 2 * loaded.model.config.n_layers + 1
    for name, writer in ((PREFILL_FILE, "Pad"), (DECODE_FILE, "ScatterElements")):
        ops, producers, outputs = optimized_ops(out / name, tmp_path)
        assert ops.count("SimplifiedLayerNormalization") == n_norms and "ReduceMean" not in ops
        assert ops.count("RotaryEmbedding") == 2 * loaded.model.config.n_layers and "GroupQueryAttention" not in ops
        assert {producers[o] for o in outputs if o.startswith("present_")} == {writer}
    assert OnnxBundleInfo.read(out).attention == "standard"


def node_modules(node, quantized: dict) -> list:
    """The INT4 modules a MatMulNBits node computes: one, or a layer's q, k and v packed side by side."""
    name = node.input[1].removesuffix(".qweight")
    if name.endswith(".qkv_proj"):
        return [quantized[name.replace("qkv_proj", proj)] for proj in ("q_proj", "k_proj", "v_proj")]
    return [quantized[name]]


def test_int4_layers_are_matmulnbits_from_packed_buffers(lowered):
    """Each INT4 layer's buffers are MatMulNBits' own, unchanged; with GroupQueryAttention a layer's q, k
    and v are one MatMulNBits over their buffers stacked (the op reads them side by side)."""
    loaded, out = lowered
    model = onnx.load(str(out / PREFILL_FILE))
    inits = {t.name: t for t in model.graph.initializer}
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    quantized = {name: m for name, m in loaded.model.named_modules() if hasattr(m, "qweight")}
    covered = [node_modules(node, quantized) for node in nbits]
    assert sorted(id(m) for ms in covered for m in ms) == sorted(id(m) for m in quantized.values())
    assert sum(len(ms) == 3 for ms in covered) == (loaded.model.config.n_layers if quantized else 0)
    for node, modules in zip(nbits, covered):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        first = modules[0]
        assert node.domain == "com.microsoft"
        assert attrs == {"K": first.in_features, "N": sum(m.out_features for m in modules), "bits": 4,
                         "block_size": first.group_size, "accuracy_level": 0}
        np.testing.assert_array_equal(numpy_helper.to_array(inits[node.input[1]]),
                                      np.concatenate([m.qweight.numpy() for m in modules]))
        np.testing.assert_array_equal(numpy_helper.to_array(inits[node.input[3]]),
                                      np.concatenate([m.qzeros.numpy().reshape(-1) for m in modules]))
    info = OnnxBundleInfo.read(out)
    assert set(info.layers) == set(quantized)


@pytest.mark.parametrize("seq", [1, 5, 33])
def test_prefill_logits_match_torch(lowered, seq):
    loaded, out = lowered
    torch.manual_seed(seq)
    ids = torch.randint(0, loaded.model.config.vocab_size, (2, seq))
    with torch.no_grad():
        ref = loaded.model(ids).numpy()
    got = OnnxRunner(out, threads=1).prefill(ids.numpy())
    assert rel_error(got, ref) < 1e-4


def test_decode_steps_match_torch_cache(lowered):
    loaded, out = lowered
    c = loaded.model.config
    torch.manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (1, 20))
    cache = ContiguousKVCache(c.n_layers, 1, MAX_LEN, c.n_kv_heads, c.head_dim, sliding_window=c.sliding_window)
    runner = OnnxRunner(out, threads=1)
    with torch.no_grad():
        ref = loaded.model(ids[:, :6], torch.arange(6)[None], cache)
        assert rel_error(runner.prefill(ids[:, :6].numpy()), ref.numpy()) < 1e-4
        for t in range(6, 20):  # one token at a time, past the sliding window
            ref = loaded.model(ids[:, t:t + 1], torch.tensor([[t]]), cache)
            assert rel_error(runner.decode(ids[:, t:t + 1].numpy()), ref.numpy()) < 1e-4


# export options -> the contrib ops the decode graph then holds
VARIANTS = {"standard attention (--no-fused-attention)": (dict(fused_attention=False), {"RotaryEmbedding"}),
            "standard attention and rotary (the ATC graph's ops)": (dict(fused_attention=False, fused_rotary=False), set()),
            "GroupQueryAttention after RotaryEmbedding": (dict(rotary_in_attention=False),
                                                          {"GroupQueryAttention", "RotaryEmbedding"}),
            "GroupQueryAttention, rotary in standard ops (--no-fused-rotary)": (dict(fused_rotary=False),
                                                                                {"GroupQueryAttention"})}


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_and_rotary_variants_are_the_same_model(lowered, tmp_path, variant):
    """Every way the attention and the rotary embedding can be written decodes the same logits as
    the default graph (GroupQueryAttention applying the rotary embedding itself)."""
    loaded, fused = lowered
    other = tmp_path / "variant"
    options, contrib = VARIANTS[variant]
    export_onnx(loaded, other, OnnxExportOptions(max_len=MAX_LEN, accuracy_level=0, **options))
    ops = {n.op_type for n in onnx.load(str(other / DECODE_FILE), load_external_data=False).graph.node}
    assert ops & {"GroupQueryAttention", "RotaryEmbedding"} == contrib
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3)).numpy()
    runners = OnnxRunner(fused, threads=1), OnnxRunner(other, threads=1)
    outs = [[r.prefill(ids[:, :6])] + [r.decode(ids[:, t:t + 1]) for t in range(6, 10)] for r in runners]
    for a, b in zip(*outs):
        assert rel_error(a, b) < 1e-5


def test_rows_of_different_lengths_decode_together(lowered):
    """Per-row lengths: prompts of 3, 11 and 6 tokens prefilled into rows of one cache, then decoded
    together one token per call (past the sliding window of 8), a row leaving half-way; every row's
    logits match the torch model run on that sequence alone."""
    loaded, out = lowered
    worst = ragged_rows_error(loaded, out, [3, 11, 6], steps=8)
    print(f"{loaded.model.config.architecture} ragged rows: worst relative error {worst:.1e}")
    assert worst < 1e-4


def test_batch_decodes_several_tokens_per_call(lowered):
    """Two rows decoding 3, 1 and 10 tokens per call (GroupQueryAttention takes several tokens per row
    on a batch with a past only given query_seqlens), past the sliding window: as the torch model."""
    loaded, out = lowered
    c = loaded.model.config
    ids = torch.randint(0, c.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    cache = ContiguousKVCache(c.n_layers, 2, MAX_LEN, c.n_kv_heads, c.head_dim, sliding_window=c.sliding_window)
    runner = OnnxRunner(out, threads=1)
    with torch.no_grad():
        ref = loaded.model(ids[:, :6], torch.arange(6)[None].expand(2, -1), cache)
        errors = [rel_error(runner.prefill(ids[:, :6].numpy()), ref.numpy())]
        for start, stop in ((6, 9), (9, 10), (10, 20)):
            ref = loaded.model(ids[:, start:stop], torch.arange(start, stop)[None].expand(2, -1), cache)
            errors.append(rel_error(runner.decode(ids[:, start:stop].numpy()), ref.numpy()))
    assert max(errors) < 1e-4


def test_standard_attention_bundle_refuses_rows_of_different_lengths(tmp_path):
    loaded = load_artifact(make_artifact(tmp_path, "llama"))
    export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=MAX_LEN, fused_attention=False))
    runner = OnnxRunner(tmp_path / "onnx", threads=1)
    cache = runner.new_cache(2)
    for row in (0, 1):
        runner.prefill_row(cache, row, np.ones((1, 3 + row), np.int64))
    with pytest.raises(ConfigError, match="one length for the whole batch.*without --no-fused-attention"):
        runner.decode_rows(cache, np.ones((2, 1), np.int64), np.array([3, 4]))
    runner.decode_rows(cache, np.ones((2, 1), np.int64), np.array([4, 4]))  # equal lengths: the one past_len


def test_bundle_without_attention_field_reads_as_standard(tmp_path):
    """Bundles written before GroupQueryAttention have no "attention" in bundle.json: their graphs are standard."""
    import json

    info = OnnxBundleInfo(target="onnx", dtype="float32", max_len=8, n_layers=1, n_kv_heads=1, head_dim=4, vocab_size=8)
    info.write(tmp_path)
    data = json.loads((tmp_path / "bundle.json").read_text())
    del data["attention"]
    (tmp_path / "bundle.json").write_text(json.dumps(data))
    assert OnnxBundleInfo.read(tmp_path).attention == "standard"


def test_int4_head_tied_or_not_is_matmulnbits_and_matches_torch(tmp_path):
    for tie in (True, False):
        loaded = load_artifact(make_artifact(tmp_path / str(tie), "llama", 32, int4_head=True, tie_word_embeddings=tie))
        out = tmp_path / f"onnx-{tie}"
        export_onnx(loaded, out, OnnxExportOptions(max_len=MAX_LEN, accuracy_level=0))
        graph = onnx.load(str(out / PREFILL_FILE), load_external_data=False).graph
        assert [n.op_type for n in graph.node if n.name.startswith("lm_head/")] == ["MatMulNBits"]
        ids = torch.randint(0, loaded.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = loaded.model(ids).numpy()
        assert rel_error(OnnxRunner(out, threads=1).prefill(ids.numpy()), ref) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_default_int8_accuracy_level_is_recorded_and_bounded(tmp_path, arch):
    """MatMulNBits at the default accuracy_level 4 quantizes each block of activations to int8:
    within 5e-2 of the torch reference on these tiny random models (SmolLM2: benchmarks/onnx_decode.py)."""
    loaded = load_artifact(make_artifact(tmp_path, arch, 32))
    info = export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=MAX_LEN))
    assert DEFAULT_ACCURACY_LEVEL == 4
    assert set(info.layers.values()) == {"MatMulNBits(bits=4, block_size=32, accuracy_level=4)"}
    assert OnnxBundleInfo.read(tmp_path / "onnx").layers == info.layers
    torch.manual_seed(3)
    ids = torch.randint(0, loaded.model.config.vocab_size, (2, 7))
    with torch.no_grad():
        ref = loaded.model(ids).numpy()
    rel = rel_error(OnnxRunner(tmp_path / "onnx", threads=1).prefill(ids.numpy()), ref)
    print(f"ONNX INT4 accuracy_level 4 vs torch reference ({arch}): {rel:.1e}")
    assert 1e-4 < rel < 5e-2  # above level 0's float32 rounding: the int8 path really runs


def test_accuracy_level_out_of_range_is_a_clear_error(tmp_path):
    loaded = load_artifact(make_artifact(tmp_path, "llama", 32))
    with pytest.raises(ConfigError, match="accuracy_level must be one of"):
        export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=MAX_LEN, accuracy_level=5))


def test_greedy_generation_identical(lowered):
    loaded, out = lowered
    torch.manual_seed(2)
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 9))
    expected = loaded.model.generate(ids, 32).numpy()
    got = OnnxRunner(out, threads=1).generate(ids.numpy(), 32)
    np.testing.assert_array_equal(got, expected)


def test_cache_overflow_is_a_clear_error(lowered):
    from compiler.errors import QCompileError

    _, out = lowered
    runner = OnnxRunner(out, threads=1)
    with pytest.raises(QCompileError, match="max_len"):
        runner.prefill(np.zeros((1, MAX_LEN + 1), np.int64))


class DequantOnlyLinearDouble(QuantizedLinear):
    """TEST DOUBLE of a non-INT4 QuantizedLinear (e.g. FP8): rounds the weight to a coarse grid and
    only offers ``dequantized_weight()``, which is what the exporter must use for such layers."""

    format_name = "test-double"

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("codes", torch.round(linear.weight.detach() * 16))
        self.bias = None

    def dequantized_weight(self):
        return self.codes / 16

    def forward(self, x):
        return torch.nn.functional.linear(x, self.dequantized_weight())


def test_other_quantized_formats_export_dequantized(tmp_path):
    loaded = load_artifact(make_artifact(tmp_path, "llama"))
    loaded.model.set_submodule("layers.0.mlp.up_proj", DequantOnlyLinearDouble(loaded.model.get_submodule("layers.0.mlp.up_proj")))
    info = export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=MAX_LEN))
    assert info.layers == {"layers.0.mlp.up_proj": "MatMul on the dequantized test-double weight"}
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_error(OnnxRunner(tmp_path / "onnx", threads=1).prefill(ids.numpy()), loaded.model(ids).numpy()) < 1e-4


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("scheme", ["none", "dynamic"])
def test_fp8_artifact_exports_dequantized(tmp_path, scheme, shift):
    from compiler.formats.fp8 import Fp8Format, Fp8Linear
    from compiler.formats.qlinear import linear_modules

    loaded = load_artifact(make_artifact(tmp_path, "llama"))
    for name, linear in linear_modules(loaded.model).items():
        if name != "lm_head":
            mean = torch.randn(linear.in_features, generator=torch.Generator().manual_seed(1)) if shift else None
            loaded.model.set_submodule(name, Fp8Linear.from_linear(linear, Fp8Format.for_linear(
                linear, activation_scheme=scheme, input_shift=shift), input_shift=mean))
    info = export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=MAX_LEN))
    assert all(how.startswith("MatMul on the dequantized fp8 weight") for how in info.layers.values())
    assert all(("activation quantization is not exported" in how) == (scheme != "none") for how in info.layers.values())
    if scheme == "none":  # weight-only FP8 is exactly what the graph computes (a shift folded into the bias)
        ids = torch.randint(0, loaded.model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = loaded.model(ids).numpy()
        assert rel_error(OnnxRunner(tmp_path / "onnx", threads=1).prefill(ids.numpy()), ref) < 1e-4
