"""Engine throughput vs transformers ``generate`` one request at a time, in the same run.

    python benchmarks/serving_throughput.py --model smollm2 --requests 16 --prompt-len 128 --output-len 128

The engine gets all ``--requests`` at once (continuous batching); the baseline runs
``--baseline-requests`` of the same prompts sequentially (its tokens/s does not depend on how
many it runs, so fewer keeps the benchmark short on a shared machine). Both are greedy, with
EOS ignored so every request produces exactly ``--output-len`` tokens. Reports output tokens/s
of each and the ratio, and how many baseline outputs the engine reproduced token for token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from serving_common import (  # noqa: E402
    corpus_prompts,
    hf_generate_one_at_a_time,
    hf_twin,
    load_model,
    run_engine,
)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--baseline-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help='torch CPU threads for both sides (see docs/BENCHMARKS.md, "Serving engine: paged KV cache, batching, prefix caching")')
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from serving.engine import Engine

    loaded = load_model(args.model)
    prompts = corpus_prompts(loaded.tokenizer, args.requests, args.prompt_len)
    engine = Engine.from_loaded(loaded, max_num_batched_tokens=args.max_num_batched_tokens)
    run_engine(engine, prompts[:2], 4)  # warm-up (allocator, kernels)
    eng = run_engine(engine, prompts, args.output_len)
    hf = hf_twin(loaded.model)
    base_s, base_tokens, base_outs = hf_generate_one_at_a_time(hf, prompts[:args.baseline_requests], args.output_len)
    eng_tps, base_tps = eng["output_tokens"] / eng["seconds"], base_tokens / base_s
    same = sum(a == b for a, b in zip(eng["outputs"], base_outs))
    result = {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "engine_tok_s": round(eng_tps, 1), "engine_s": round(eng["seconds"], 2), "engine_steps": eng["steps"],
              "engine_ttft_mean_s": round(eng["ttft_mean_s"], 3), "baseline_requests": args.baseline_requests,
              "baseline_tok_s": round(base_tps, 1), "baseline_s": round(base_s, 2), "ratio": round(eng_tps / base_tps, 2),
              "outputs_identical": f"{same}/{len(base_outs)}", "torch_threads": torch.get_num_threads()}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
