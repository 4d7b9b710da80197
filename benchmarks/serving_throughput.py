"""Continuous batching: the engine's output tokens/s (``qcompile bench``) against transformers ``generate``
one request at a time, on the same prompts, in the same run.

    python benchmarks/serving_throughput.py --model smollm2 --requests 16 --baseline-requests 4 --prompt-len 128 --output-len 128

The engine side is ``qcompile bench MODEL --concurrency R --num-requests R --warmup 1`` (the in-process
engine, closed loop: all ``--requests`` at once); ``--model`` is an artifact, or a checkpoint compiled
to a float artifact first. The baseline runs ``--baseline-requests`` of the same prompt ids through
transformers' LlamaForCausalLM holding the same weights, greedy, one after another (its tokens/s does
not depend on how many it runs). Both ignore EOS, so every request makes ``--output-len`` tokens.
That the engine's greedy tokens equal transformers' is tests/serving/test_serving_engine.py's job.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402


def artifact_of(spec: str, work: Path) -> Path:
    """``spec`` itself when it is an artifact, else its float compile in ``work``."""
    if (Path(spec) / "manifest.json").is_file():
        return Path(spec)
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    return compile_model(spec, PipelineConfig(), work / "float").path


def hf_twin(model):
    """transformers' LlamaForCausalLM holding the same weights (the baseline for ``generate``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    if c.architecture != "LlamaForCausalLM":
        raise SystemExit("the transformers baseline is built for Llama checkpoints only")
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                      head_dim=c.head_dim, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                      max_position_embeddings=c.max_seq_len, tie_word_embeddings=c.tie_embeddings,
                      bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    hf = LlamaForCausalLM(cfg).eval()
    state = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (c.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the transformers twin does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(next(model.parameters()).dtype)


@torch.inference_mode()
def generate_one_at_a_time(hf, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy ``generate`` per prompt, one after another."""
    tokens, start = 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        tokens += out.shape[1] - len(p)
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "seconds": seconds, "requests": len(prompts)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="an artifact, or a checkpoint (compiled to float first)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--baseline-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help='torch CPU threads for both sides (see docs/BENCHMARKS.md, "Serving engine: paged KV cache, batching, prefix caching")')
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from compiler.io.load import load_checkpoint
    from serving.bench.benchmark import load_points, run_benchmark
    from serving.bench.workload import LengthDist, WorkloadConfig, build_requests

    workload = WorkloadConfig(LengthDist("fixed", args.prompt_len), LengthDist("fixed", args.output_len))
    with tempfile.TemporaryDirectory() as work:
        artifact = artifact_of(args.model, Path(work))
        bench = run_benchmark(str(artifact), workload, load_points([args.requests], num_requests=args.requests, warmup=1),
                              engine_plan={"max_num_batched_tokens": args.max_num_batched_tokens})
        loaded = load_checkpoint(artifact)
    metrics = bench["runs"][0]["metrics"]
    prompts = [r.prompt for r in build_requests(workload, loaded.tokenizer, args.baseline_requests)]
    base = generate_one_at_a_time(hf_twin(loaded.model), prompts, args.output_len)
    engine_tok_s = metrics["output_token_throughput"]["mean"]
    row = {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
           "engine_tok_s": engine_tok_s, "engine_ttft_mean_ms": metrics["time_to_first_token"]["mean"],
           "engine_output_length_mismatch": metrics["counts"]["output_length_mismatch"],
           "baseline_requests": base["requests"], "baseline_tok_s": base["tok_s"], "ratio": engine_tok_s / base["tok_s"]}
    print(f"engine {engine_tok_s:.1f} tok/s ({args.requests} concurrent) against generate {base['tok_s']:.1f} tok/s "
          f"(one at a time): {row['ratio']:.2f}x")
    return write_result(args.json, [row], model=args.model, bench=bench)


if __name__ == "__main__":
    main()
