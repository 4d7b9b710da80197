"""The real SmolLM2-135M through ONNX Runtime: INT4 (RTN g64, MatMulNBits) parity with torch."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from onnx_helpers import rel_error

from backends.onnx.export import OnnxExportOptions, export_onnx
from backends.onnx.runner import OnnxRunner
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import linear_modules
from compiler.kernels.int4_cpu import reference_only


@pytest.mark.slow
def test_smollm2_int4_onnx_parity(smollm2, tmp_path):
    loaded = copy.copy(smollm2)
    loaded.model = copy.deepcopy(smollm2.model)
    for name, linear in linear_modules(loaded.model).items():
        if name != "lm_head":
            loaded.model.set_submodule(name, Int4Linear.from_float(linear, 64))
    export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=96, accuracy_level=0))  # float32 MatMulNBits
    runner = OnnxRunner(tmp_path / "onnx")
    # The torch reference: Int4Linear's reference_forward is F.linear on dequantized_weight(); doing the
    # dequantization once (in a float twin) computes the same thing without unpacking every step.
    reference = copy.deepcopy(smollm2.model)
    for name, module in linear_modules(reference).items():
        if name != "lm_head":
            module.weight.data = loaded.model.get_submodule(name).dequantized_weight()
    ids = torch.tensor([loaded.tokenizer("def fibonacci(n):")["input_ids"]])
    with torch.no_grad(), reference_only():
        logits = loaded.model(ids).numpy()
        assert rel_error(reference(ids).numpy(), logits) < 1e-5  # the twin is the INT4 model
        assert rel_error(runner.prefill(ids.numpy()), logits) < 1e-4
    np.testing.assert_array_equal(runner.generate(ids.numpy(), 32), reference.generate(ids, 32).numpy())
