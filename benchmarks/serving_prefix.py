"""Prefix sharing: 16 requests with a common 256-token prefix, prefix caching on vs off.

    python benchmarks/serving_prefix.py --model smollm2 --requests 16 --prefix-len 256 --suffix-len 32 --output-len 32

All requests are submitted at once. Reports, for caching on and off in the same run: prompt
tokens computed (prefill work), tokens served from the cache, mean time to first token, and
the TTFT ratio; and whether both runs produced identical (greedy) outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from serving_common import corpus_prompts, load_model, run_engine  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from serving.engine import Engine

    loaded = load_model(args.model)
    (prefix,) = corpus_prompts(loaded.tokenizer, 1, args.prefix_len)
    suffixes = corpus_prompts(loaded.tokenizer, args.requests, args.suffix_len, offset=args.prefix_len // args.suffix_len + 1)
    prompts = [prefix + s for s in suffixes]
    runs = {}
    for caching in (False, True):
        engine = Engine.from_loaded(loaded, enable_prefix_caching=caching)
        run_engine(engine, [suffixes[0]], 2)  # warm-up on an unrelated prompt
        before = engine.scheduler.stats.num_computed_tokens
        r = run_engine(engine, prompts, args.output_len)
        st = engine.scheduler.stats
        decode_tokens = args.requests * (args.output_len - 1)
        runs["on" if caching else "off"] = {
            "prompt_tokens_computed": st.num_computed_tokens - before - decode_tokens,
            "prompt_tokens_from_cache": st.num_cached_prompt_tokens,
            "ttft_mean_s": round(r["ttft_mean_s"], 3), "total_s": round(r["seconds"], 2), "outputs": r["outputs"]}
    on, off = runs["on"], runs["off"]
    result = {"requests": args.requests, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
              "output_len": args.output_len,
              **{f"{k}_{name}": v for name, run in runs.items() for k, v in run.items() if k != "outputs"},
              "prefill_tokens_saved": off["prompt_tokens_computed"] - on["prompt_tokens_computed"],
              "ttft_ratio_off_over_on": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
              "outputs_identical": on["outputs"] == off["outputs"]}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
