"""Run with vLLM's Python (it carries compressed-tensors): decompress a checkpoint with compressed-tensors' own code.

    python ct_decompress.py CHECKPOINT_DIR OUT.safetensors

Validates ``config.json``'s ``quantization_config`` with compressed-tensors' ``QuantizationConfig``,
then for every target of every config group hands the layer's stored tensors to the compressor
registered for the group's format (``decompress``) and saves the float weight it gives back
under the layer's name. The test compares those with the artifact's ``dequantized_weight()``.
"""
import json
import sys
from pathlib import Path

from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import save_file


def main(checkpoint: Path, out: Path) -> None:
    raw = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    weights = {}
    for group in config.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(group.format)
        for layer in group.targets:
            state = {k.removeprefix(layer + "."): v for k, v in tensors.items() if k.startswith(layer + ".")}
            weights[layer] = compressor.decompress(state, group)["weight"].contiguous()
    save_file(weights, str(out))
    print(json.dumps({"layers": len(weights), "formats": sorted({g.format for g in config.config_groups.values()})}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
