"""Ascend lowering: ATC op check, the atc invocation (against tests/doubles/atc); the vllm-ascend
directory is in test_ascend_v1.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx_helpers import make_artifact

from backends.ascend.atc import AtcFailed, AtcNotFound, AtcOptions
from backends.ascend.lower import lower_ascend
from backends.ascend.msmodelslim import DIRECTORY
from backends.ascend.ops import check_ops
from backends.onnx.export import OnnxExportOptions, export_graphs
from compiler.errors import ConfigError
from compiler.io.artifact import load_artifact

DOUBLES = Path(__file__).resolve().parents[2] / "doubles"
OPTS = AtcOptions("Ascend910B3", (32, 64, 128))


@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory):
    return make_artifact(tmp_path_factory.mktemp("ascend"), "llama", 32)


@pytest.fixture
def atc_double(monkeypatch, tmp_path):
    """tests/doubles/atc first on PATH; returns a reader of the argument lists it recorded."""
    log = tmp_path / "atc-calls.jsonl"
    monkeypatch.setenv("PATH", f"{DOUBLES}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("ATC_DOUBLE_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# -- operator compatibility -----------------------------------------------------------------
def _planted(op_type: str, domain: str = "", opset: int = 17) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="fine_relu"),
             helper.make_node(op_type, ["r"], ["y"], name=f"planted_{op_type}", domain=domain)]
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=opsets)


@pytest.mark.parametrize("op_type,domain,opset", [("MatMulNBits", "com.microsoft", 1), ("DequantizeLinear", "", 17),
                                                  ("QuantizeLinear", "", 17)])
def test_op_check_reports_planted_node(op_type, domain, opset):
    offenses = check_ops(_planted(op_type, domain), "planted")
    assert [(o.node, o.op_type, o.domain, o.opset) for o in offenses] == [(f"planted_{op_type}", op_type, domain, opset)]
    assert "msModelSlim" in offenses[0].way_out or "AMCT" in offenses[0].way_out


def test_op_check_reports_loop_and_opset_out_of_range():
    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"], name="body_id")], "body",
                             [helper.make_tensor_value_info(n, t, []) for n, t in
                              (("i", TensorProto.INT64), ("cond", TensorProto.BOOL), ("c", TensorProto.FLOAT))],
                             [helper.make_tensor_value_info(n, t, []) for n, t in
                              (("cond_out", TensorProto.BOOL), ("c_out", TensorProto.FLOAT))])
    loop = helper.make_node("Loop", ["n", "cond0", "x"], ["y"], name="the_loop", body=body)
    graph = helper.make_graph([loop], "g", [helper.make_tensor_value_info(n, t, []) for n, t in
                                            (("n", TensorProto.INT64), ("cond0", TensorProto.BOOL), ("x", TensorProto.FLOAT))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    offenses = check_ops(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "m")
    assert [(o.node, o.op_type, o.opset) for o in offenses] == [("the_loop", "Loop", 17)]
    assert "unroll" in offenses[0].way_out
    too_new = check_ops(_planted("Relu", opset=19), "m")
    assert {o.node for o in too_new} == {"fine_relu", "planted_Relu"} and "opset 8..17" in too_new[0].reason


def test_exported_fp16_graphs_pass_op_check(int4_artifact):
    loaded = load_artifact(int4_artifact)
    for graph in export_graphs(loaded.model, OnnxExportOptions(max_len=128, dtype="float16", batch=1, dequantize=True)):
        assert check_ops(graph) == []
    # while the ONNX Runtime export of the same INT4 model is caught (its contrib ops), with either attention
    nbits = export_graphs(loaded.model, OnnxExportOptions(max_len=128))[0]
    assert {o.op_type for o in check_ops(nbits)} == {"MatMulNBits", "GroupQueryAttention"}
    standard = export_graphs(loaded.model, OnnxExportOptions(max_len=128, fused_attention=False))[0]
    assert {o.op_type for o in check_ops(standard)} == {"MatMulNBits", "RotaryEmbedding"}


# -- the atc invocation ---------------------------------------------------------------------
@pytest.mark.integration
def test_atc_flags_gears_soc_precision(int4_artifact, atc_double, tmp_path):
    out = tmp_path / "bundle"
    result = lower_ascend(load_artifact(int4_artifact), out, OPTS, max_len=128)
    calls = atc_double()
    assert [c[1] for c in calls] == ["--model=prefill.onnx", "--model=decode.onnx"]
    prefill, decode = calls
    for call in calls:
        assert "--framework=5" in call and "--soc_version=Ascend910B3" in call and "--input_format=ND" in call
        assert "--precision_mode=force_fp16" in call and not any(a.startswith("--precision_mode_v2") for a in call)
        assert not any(a.startswith("--dynamic_batch_size") for a in call)
    assert "--input_shape=input_ids:1,-1" in prefill and "--dynamic_dims=32;64;128" in prefill
    assert not any(a.startswith("--dynamic_dims") for a in decode)
    assert sorted(p.name for p in result.om_files) == ["decode.om", "prefill.om"]
    assert (out / "atc.log").exists() and not list(out.glob(".om.tmp*"))


@pytest.mark.integration
def test_precision_mode_v2_replaces_v1(int4_artifact, atc_double, tmp_path):
    opts = AtcOptions("Ascend910B3", (32, 64), precision_mode_v2="origin")
    lower_ascend(load_artifact(int4_artifact), tmp_path / "b", opts, max_len=64)
    for call in atc_double():
        assert "--precision_mode_v2=origin" in call and not any(a.startswith("--precision_mode=") for a in call)


@pytest.mark.integration
def test_atc_error_surfaced_with_node_and_nothing_half_written(int4_artifact, atc_double, monkeypatch, tmp_path):
    loaded = load_artifact(int4_artifact)
    node = next(n.name for n in export_graphs(loaded.model, OnnxExportOptions(max_len=128, dtype="float16", batch=1, dequantize=True))[0].graph.node
                if n.op_type == "Softmax")
    monkeypatch.setenv("ATC_DOUBLE_MODE", "fail")
    monkeypatch.setenv("ATC_DOUBLE_NODE", node)
    out = tmp_path / "bundle"
    with pytest.raises(AtcFailed) as err:
        lower_ascend(loaded, out, OPTS, max_len=128)
    assert err.value.exit_code == 4
    assert "E10001" in str(err.value) and f"node {node} (Softmax)" in str(err.value)
    assert "atc.log" in str(err.value) and "E10001" in (out / "atc.log").read_text()
    assert not list(out.rglob("*.om")) and not list(out.glob(".om.tmp*")) and not (out / "om").exists()
    assert (out / "bundle.json").exists() and (out / "build_om.sh").exists()  # the bundle itself is whole


@pytest.mark.integration
def test_atc_success_without_om_is_an_error(int4_artifact, atc_double, monkeypatch, tmp_path):
    monkeypatch.setenv("ATC_DOUBLE_MODE", "no-om")
    with pytest.raises(AtcFailed, match="wrote no prefill, decode .om"):
        lower_ascend(load_artifact(int4_artifact), tmp_path / "b", OPTS, max_len=128)


def test_without_atc_bundle_written_and_distinct_exit(int4_artifact, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    out = tmp_path / "bundle"
    monkeypatch.setattr(sys, "argv", ["qcompile", "lower", str(int4_artifact), "--target", "ascend", "--soc",
                                      "Ascend910B3", "--max-len", "128", "--buckets", "32,64,128", "-o", str(out)])
    from qcompile.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == AtcNotFound.exit_code == 3
    assert {p.name for p in out.iterdir()} == {"prefill.onnx", "decode.onnx", "weights.data", "bundle.json", "build_om.sh"}
    assert not list(out.rglob("*.om"))
    # INT4 has no AscendV1 form vllm-ascend loads (W4A16 is for MoE experts there): no directory, one note why
    notes = json.loads((out / "bundle.json").read_text())["extras"]["notes"]
    assert [n for n in notes if n.startswith(f"no {DIRECTORY}/ directory: vllm-ascend runs INT4 weight-only")]
    printed = " ".join(capsys.readouterr().out.split())  # the bundle's notes are shown before the error
    assert all(" ".join(f"note: {n}".split()) in printed for n in notes)


@pytest.mark.parametrize("opts,match", [(AtcOptions("Ascend910B3", (64,)), "2 to 100"),
                                        (AtcOptions("Ascend910B3", (64, 32)), "ascending"),
                                        (AtcOptions("Ascend910B3", (64, 256)), "exceeds --max-len"),
                                        (AtcOptions("Ascend910B3", (32, 64), "force_fp16", "fp16"), "not both"),
                                        (AtcOptions("Ascend910X", (32, 64)), "npu-smi")])
def test_bad_atc_options_fail_before_writing(int4_artifact, tmp_path, opts, match):
    with pytest.raises(ConfigError, match=match):
        lower_ascend(load_artifact(int4_artifact), tmp_path / "b", opts, max_len=128)
    assert not (tmp_path / "b").exists()


def test_int4_group_not_dividing_in_features_still_lowers(tmp_path, monkeypatch):
    """The dequantized fp16 graphs take any group size (no msModelSlim W4A16 layout constrains it now)."""
    from compiler.deploy.targets import check_formats

    artifact = make_artifact(tmp_path, "llama", 64)  # down_proj in_features 96 is not a multiple of 64
    check_formats("ascend", load_artifact(artifact).manifest.modules)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(AtcNotFound):
        lower_ascend(load_artifact(artifact), tmp_path / "b", OPTS, max_len=128)
    assert (tmp_path / "b" / "prefill.onnx").exists()


def test_fp16_ascend_graph_is_the_model(int4_artifact, monkeypatch, tmp_path):
    """The ATC-ready graph (fp16, dequantized, static batch) run by ONNX Runtime tracks the torch model."""
    from backends.onnx.runner import OnnxRunner

    loaded = load_artifact(int4_artifact)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(AtcNotFound):
        lower_ascend(loaded, tmp_path / "b", OPTS, max_len=128)
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = loaded.model(ids).numpy()
    runner = OnnxRunner(tmp_path / "b", threads=1)
    got = runner.prefill(ids[:, :8].numpy())
    # decode: the static one-token graph writes its slot by Where, in place in the runner's cache
    got = np.concatenate([got] + [runner.decode(ids[:, t:t + 1].numpy()) for t in range(8, 12)], axis=1)
    got = got.astype(np.float32)
    assert not np.isnan(got).any()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2  # fp16 activations

