"""vLLM's perplexity of a checkpoint from ``qcompile lower --target vllm``, on the shared protocol:
the first ``--windows`` 512-token windows of the corpus's evaluation region, scored by vLLM's prompt
log-probabilities (``backends/vllm/evaluate.py``), so that it compares with ``qcompile eval`` of
the artifact. vLLM runs with ``--enforce-eager`` (no torch.compile warm-up).

    python benchmarks/vllm_perplexity.py CHECKPOINT [--corpus pydoc] [--windows 16] [--json FILE]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402


def vllm_perplexity(checkpoint: Path, corpus: str = "pydoc", windows: int = 16) -> dict:
    """``{"ppl", "tokens", "nll"}`` of vLLM serving ``checkpoint`` (its own tokenizer splits the corpus)."""
    from transformers import AutoTokenizer

    from backends.triton.runtime import free_port
    from backends.vllm.evaluate import server_perplexity
    from backends.vllm.runtime import VllmOptions, VllmServer
    from calib import evaluation_windows
    from compiler.pipeline.evaluate import corpus_split

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    scored = evaluation_windows(corpus_split(tokenizer, corpus).evaluation, windows, 512)
    opts = VllmOptions(checkpoint, port=free_port(), served_name="qcompile-eval", max_model_len=1024,
                       extra_args=["--enforce-eager"])
    with tempfile.TemporaryDirectory() as tmp, VllmServer(opts, log_path=Path(tmp) / "vllm.log") as server:
        return server_perplexity(server.url, server.model, scored)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--corpus", default="pydoc")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    row = {"checkpoint": str(args.checkpoint), "corpus": args.corpus, "windows": args.windows,
           **vllm_perplexity(args.checkpoint, args.corpus, args.windows)}
    print(f"vLLM's perplexity of {args.checkpoint} on {args.corpus}: {row['ppl']:.4f} ({row['tokens']} tokens)")
    return write_result(args.json, [row])


if __name__ == "__main__":
    main()
