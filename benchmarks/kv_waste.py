"""KV-cache waste at steady state: paged blocks vs contiguous max-length reservation.

    python benchmarks/kv_waste.py --steps 3000 --warmup 1000 --seed 0

Drives the engine's real scheduler and KV manager (no model: each step "computes" the
scheduled tokens and appends one output token where a request's tokens are all computed) on
a workload of requests whose final lengths are uniform in [--min-len, --max-len] (prompt a
uniform 10–50 % of it), with a queue that never runs dry. After the warm-up, at every step:

    waste = 1 - (slots holding KV) / (slots allocated)

paged: allocated = blocks held x block_size. contiguous: every running request reserves
``--reserve`` slots (the workload's max length, and the model-style 2048), the way a
contiguous cache must. Also reports how many requests run at once in the same memory.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from benchmarks.common import write_result  # noqa: E402
from serving.kv_manager import KVCacheManager  # noqa: E402
from serving.request import Request  # noqa: E402
from serving.scheduler import Scheduler  # noqa: E402
from serving.types import SamplingParams  # noqa: E402


def make_request(i: int, rng: random.Random, min_len: int, max_len: int) -> Request:
    total = rng.randint(min_len, max_len)
    prompt = max(1, int(total * rng.uniform(0.1, 0.5)))
    tokens = [rng.randrange(1, 50_000) for _ in range(prompt)]
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=total - prompt, ignore_eos=True), [], None,
                   torch.device("cpu"), 0)


def simulate(args) -> dict:
    rng = random.Random(args.seed)
    kv = KVCacheManager(args.num_blocks, args.block_size, enable_caching=False)
    sched = Scheduler(kv, args.max_num_batched_tokens, args.max_num_seqs)
    n = 0
    used_sum = alloc_sum = running_sum = samples = 0
    per_reserve = {r: 0 for r in args.reserve}
    for step in range(args.steps):
        while len(sched.waiting) < 8:  # keep the queue full: steady state under load
            sched.add(make_request(n, rng, args.min_len, args.max_len))
            n += 1
        out = sched.schedule()
        for req, k in out.scheduled:
            req.num_computed_tokens += k
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(1)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    req.finish("length")
                    sched.finish(req)
        if step >= args.warmup:
            used = sum(r.num_computed_tokens for r in sched.running)
            held = sum(len(kv.req_blocks[r.request_id]) for r in sched.running) * args.block_size
            used_sum, alloc_sum = used_sum + used, alloc_sum + held
            running_sum += len(sched.running)
            samples += 1
            for r in args.reserve:
                per_reserve[r] += len(sched.running) * r
    pool_tokens = args.num_blocks * args.block_size
    return {
        "workload": f"lengths uniform in [{args.min_len}, {args.max_len}], prompt 10-50%",
        "pool_tokens": pool_tokens, "block_size": args.block_size, "steps_measured": samples,
        "paged_waste_pct": round(100 * (1 - used_sum / alloc_sum), 2),
        "paged_mean_running": round(running_sum / samples, 1),
        "preemptions": sched.stats.num_preemptions,
        "contiguous": {str(r): {"waste_pct": round(100 * (1 - used_sum / per_reserve[r]), 2),
                                "max_running_same_memory": pool_tokens // r} for r in args.reserve},
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--reserve", type=int, nargs="+", default=[1000, 2048])
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    row = simulate(args)
    print(f"KV-cache waste: paged {row['paged_waste_pct']}% ({row['paged_mean_running']} requests at once), "
          + ", ".join(f"contiguous reserving {r}: {c['waste_pct']}%" for r, c in row["contiguous"].items()))
    return write_result(args.json, [row])


if __name__ == "__main__":
    main()
