"""The ONNX bundle that ``qcompile lower --target onnx|ascend`` writes and the runtimes read.

    DIR/
      bundle.json        this module's ``OnnxBundleInfo``
      prefill.onnx       input_ids [B, T] (attention "gqa": and the cache buffers past_key.i / past_value.i)
                         -> logits, present_key.i / present_value.i
      decode.onnx        input_ids [B, T], past_len [1] ("gqa": past_lens [B], one per row),
                         past_key.i / past_value.i -> the same
      weights.data       external data shared by both graphs
      tokenizer files    when the artifact has a tokenizer

Lives beside the exporter that writes it; the readers (``backends/onnx/runner.py``, the serving
adapters above) import it from here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from compiler.errors import ArtifactError

BUNDLE_FILE = "bundle.json"
PREFILL_FILE = "prefill.onnx"
DECODE_FILE = "decode.onnx"
WEIGHTS_FILE = "weights.data"
BUNDLE_VERSION = 1


@dataclass
class OnnxBundleInfo:
    """Shapes and names a runtime needs to drive the two graphs and keep the KV cache."""

    target: str  # "onnx" | "ascend"
    dtype: str  # float32 | float16
    max_len: int  # cache length L
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    batch: int | None = None  # None: dynamic
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer: bool = False
    layers: dict[str, str] = field(default_factory=dict)  # module -> how it was exported
    extras: dict = field(default_factory=dict)  # target-specific (Ascend: buckets, soc, om files)
    # "standard": one past_len for the batch (backends/onnx/attention.py); "gqa": GroupQueryAttention,
    # a length per row, so rows of different lengths decode together. Older bundles are "standard".
    attention: str = "standard"
    version: int = BUNDLE_VERSION

    def write(self, directory: Path) -> None:
        (Path(directory) / BUNDLE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, directory: str | Path) -> "OnnxBundleInfo":
        path = Path(directory) / BUNDLE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"{directory}: no {BUNDLE_FILE}; lower an artifact first with 'qcompile lower ARTIFACT --target onnx -o DIR'") from None
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path}: corrupt ({e}); lower the artifact again") from None
        if data.get("version") != BUNDLE_VERSION:
            raise ArtifactError(f"{path}: bundle version {data.get('version')}, this qcompile reads {BUNDLE_VERSION}; lower the artifact again")
        return cls(**data)
