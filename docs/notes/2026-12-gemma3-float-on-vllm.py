"""vLLM CPU's perplexity on the float Gemma 3 270M export, on the pydoc evaluation windows of
benchmarks/int8_quality.py (qcompile eval's float figure there: 27.2975). A study script for
docs/BENCHMARKS.md, "INT8 W8A8 (Gemma 3 270M)": whether vLLM's offset on the INT8 exports is its float
model's or its INT8 kernels'. Run from the repository root: python docs/notes/2026-12-gemma3-float-on-vllm.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import backends  # noqa: E402,F401
import passes  # noqa: E402,F401
from benchmarks.int8_quality import vllm_perplexity  # noqa: E402
from calib import evaluation_windows  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.pipeline import PipelineConfig  # noqa: E402
from compiler.pipeline.compile import compile_loaded  # noqa: E402
from compiler.pipeline.evaluate import corpus_split  # noqa: E402

source = load_checkpoint("gemma3-270m", dtype="float32")
windows = evaluation_windows(corpus_split(source.tokenizer, "pydoc").region("evaluation"), 16, 512)
with tempfile.TemporaryDirectory() as tmp:
    cfg = PipelineConfig.from_dict({"model": {"dtype": "float32"}, "passes": []})
    art = compile_loaded(source, cfg, Path(tmp) / "float").path
    print("vLLM float", vllm_perplexity(art, Path(tmp), windows), flush=True)
