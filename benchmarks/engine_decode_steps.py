"""The engine's decode step on the CPU: wall and thread-CPU ms per step, several models in one process.

    python benchmarks/engine_decode_steps.py ARTIFACT [ARTIFACT ...] [--threads 1] [--conc 1,16] [--steps 10] [--rounds 1] [--json FILE]

Each ARTIFACT (or ``smollm2`` for the built-in float model; ``ARTIFACT:w4a8`` serves an INT4 one
with ``int4_compute = "w4a8"``) gets an ``Engine``; per concurrency C,
C random ``--prompt-len``-token prompts are prefilled, then ``--steps`` decode steps (C tokens each) are timed
(``benchmarks/common.py``: median and p90 of the steps, on the wall clock and this thread's CPU time).
At one thread the thread-CPU time of a step barely depends on other processes (they take turns on
the cores but do not add to this thread's time), so on a shared machine it is the figure to compare
(wall time is printed too); memory-bandwidth contention still inflates it somewhat. Rounds
interleave the models, so that load falls on all of them alike.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timing, time_call, write_result  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.types import SamplingParams  # noqa: E402


def engine_for(spec: str) -> Engine:
    if spec == "smollm2":
        from compiler.io.load import load_checkpoint

        return Engine.from_loaded(load_checkpoint("smollm2"), device="cpu")
    path, _, compute = spec.partition(":")
    return Engine.from_artifact(path, device="cpu", **({"int4_compute": compute} if compute else {}))


def decode_steps(engine: Engine, concurrency: int, steps: int, timing: Timing, prompt_len: int = 128) -> None:
    """Adds the wall and thread-CPU seconds of each timed decode step to ``timing`` (one step untimed first)."""
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=steps + 3, ignore_eos=True)
    for _ in range(concurrency):
        engine.add_request(prompt_token_ids=torch.randint(0, engine.config.vocab_size, (prompt_len,)).tolist(), params=params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.step()
    for _ in range(steps):
        _, seconds = time_call(engine.step, ("wall", "thread"))
        timing.add(**seconds)
    while engine.has_unfinished():
        engine.step()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="artifact directories, or smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--conc", default="1,16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {m: engine_for(m) for m in args.models}
    times: dict[tuple[str, int], Timing] = {}
    for _ in range(args.rounds):
        for c in [int(v) for v in args.conc.split(",")]:
            for name, engine in engines.items():
                decode_steps(engine, c, args.steps, times.setdefault((name, c), Timing()), args.prompt_len)
    rows = []
    for (name, c), timing in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        wall, cpu = timing.stats("wall"), timing.stats("thread")
        print(f"{name[-28:]:>28} c={c:<3} wall median {wall['p50']:7.1f} ms/step | "
              f"thread CPU median {cpu['p50']:7.1f}, p90 {cpu['p90']:7.1f} ms/step")
        rows.append({"model": name, "concurrency": c, "wall_ms": wall["p50"], "wall_p90_ms": wall["p90"],
                     "thread_cpu_ms": cpu["p50"], "thread_cpu_p90_ms": cpu["p90"], "steps": cpu["count"]})
    return write_result(args.json, rows, threads=args.threads, rounds=args.rounds)


if __name__ == "__main__":
    main()
