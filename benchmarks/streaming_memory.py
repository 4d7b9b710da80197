"""Peak memory of streamed against in-memory compiles (issue 25), in a subprocess per compile.

1. Depth: random Llama checkpoints of one width (hidden 512, MLP 1408, 8 heads on 2 KV heads,
   float32; 11 MB a block) and 8, 16 and 32 layers, compiled with AWQ streamed and in memory. Each compile runs
   in its own process; its peak RSS is that process's ``VmHWM`` (file-backed pages included: an
   in-memory load maps the whole checkpoint). The goal: the streamed peak flat within 15% across
   depths.
2. Bigger than the footprint: a 128-layer checkpoint of that width (1.5 GB of float weights) compiled
   streamed (by default with weight-only FP8, the cheapest pass over every weight; ``--big-pipelines
   awq,fp8`` adds those, hours on 2 shared cores) inside a cgroup whose memory limit is below the checkpoint's size (cgroup
   v1 or v2, a child of this process's own cgroup; where none can be made, the run says so and
   reports peak RSS against the checkpoint's size), then checked against the in-memory compile:
   every tensor's SHA-256 equal, and the reloaded artifacts' logits equal. The memory plan's
   refusal of the in-memory compile at that limit is shown too.

    python benchmarks/streaming_memory.py                       # the table, docs/data/streaming_memory.json (--json)
    python benchmarks/streaming_memory.py --depths 8 --big-layers 64 --limit 768MiB

AWQ runs with a short search (α grid 2, no clip search or module scoring, round-to-nearest) and
8 × 128 calibration tokens: the footprint, not the quality, is measured here (and on 2 shared
cores the full search would take hours at these depths).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_result  # noqa: E402

WIDTH = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2)
BIG_LAYERS = 128  # 1.5 GB of float32 weights, for the compiles under a smaller cgroup limit
CALIBRATION = {"samples": 8, "seq_len": 128, "seed": 0}
PIPELINES = {
    "awq": [{"name": "awq", "group_size": 128, "alpha_grid": 2, "clip_search": False, "module_candidates": 0,
             "weight_rounding": "nearest"}],
    "fp8": [{"name": "fp8", "weight_rounding": "nearest"}],
    # weight-only FP8 with no calibration: the cheapest full pass over every block's weights
    "fp8-weights": [{"name": "fp8", "activation_scheme": "none", "input_shift": False, "max_layer_error": None,
                     "weight_rounding": "nearest"}],
}


def make_checkpoint(path: Path, n_layers: int, tokenizer_dir: Path) -> int:
    """A random Llama checkpoint written shard by shard (8 layers a shard); returns its weights' bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    path.mkdir(parents=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=n_layers, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2, torch_dtype="float32", **WIDTH)
    d, i, hd = config.hidden_size, config.intermediate_size, d_head(config)
    kv = config.num_key_value_heads * hd
    g = torch.Generator().manual_seed(n_layers)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, d), "mlp.gate_proj": (i, d), "mlp.up_proj": (i, d), "mlp.down_proj": (d, i)}
    shards, weight_map = [], {}
    for start in range(0, n_layers, 8):
        state = {}
        for layer in range(start, min(start + 8, n_layers)):
            p = f"model.layers.{layer}."
            state |= {f"{p}{n}.weight": rand(*s) for n, s in shapes.items()}
            state |= {f"{p}input_layernorm.weight": torch.ones(d), f"{p}post_attention_layernorm.weight": torch.ones(d)}
        if start == 0:
            state |= {"model.embed_tokens.weight": rand(config.vocab_size, d), "model.norm.weight": torch.ones(d),
                      "lm_head.weight": rand(config.vocab_size, d)}
        shards.append(state)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for name, state in zip(names, shards):
        save_file(state, str(path / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in state}
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return total


def d_head(config) -> int:
    return config.hidden_size // config.num_attention_heads


def make_tokenizer(folder: Path) -> Path:
    if not (folder / "tokenizer.json").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_byte_tokenizer

        make_byte_tokenizer().save_pretrained(str(folder))
    return folder


# --- one compile, in a child process ---------------------------------------------------------

def child(args) -> None:
    """Compile once and print {"peak_rss_bytes", "wall_s", "streamed", "planned_bytes"} as JSON."""
    os.environ.setdefault("QCOMPILE_PROGRESS", "0")
    import passes  # noqa: F401
    from compiler.errors import QCompileError
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = PipelineConfig.from_dict({"calibration": {**CALIBRATION, "corpus": args.corpus},
                                       "passes": PIPELINES[args.pipeline]})
    start = time.perf_counter()
    try:
        result = compile_model(args.model, config, args.out, force=True, streaming=args.streaming,
                               memory_limit=args.memory_limit)
    except QCompileError as e:
        print(json.dumps({"refused": str(e), "peak_rss_bytes": _hwm()}))
        return
    print(json.dumps({"peak_rss_bytes": _hwm(), "wall_s": round(time.perf_counter() - start, 1),
                      "streamed": result.streamed, "planned_bytes": result.memory.total}))


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# --- cgroups ----------------------------------------------------------------------------------

def make_cgroup(limit: int) -> Path | None:
    """A child of this process's memory cgroup limited to ``limit`` bytes, or None where none can be made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            base, limit_file = Path("/sys/fs/cgroup") / where.lstrip("/"), "memory.max"
        elif "memory" in controllers.split(","):
            base, limit_file = Path("/sys/fs/cgroup/memory") / where.lstrip("/"), "memory.limit_in_bytes"
        else:
            continue
        group = base / f"qcompile-streaming-{os.getpid()}"
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit))
            if limit_file == "memory.max":
                (group / "memory.swap.max").write_text("0")
            return group
        except OSError:
            if group.exists():
                group.rmdir()
    return None


def run_child(args, model: Path, out: Path, pipeline: str, streaming: str, cgroup: Path | None = None,
              memory_limit: int | None = None) -> dict:
    command = [sys.executable, __file__, "--child", "--model", str(model), "--out", str(out), "--pipeline", pipeline,
               "--streaming", streaming, "--corpus", args.corpus]
    if memory_limit:
        command += ["--memory-limit", str(memory_limit)]
    preexec = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    proc = subprocess.run(command, capture_output=True, text=True, preexec_fn=preexec,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=3600)
    if proc.returncode:
        return {"failed": f"exit {proc.returncode}" + (" (killed: out of memory)" if proc.returncode < 0 else ""),
                "stderr": proc.stderr[-400:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> bool:
    ta, tb = (json.loads((p / "manifest.json").read_text())["tensors"] for p in (a, b))
    return ta == tb


def same_logits(a: Path, b: Path) -> bool:
    import torch

    from compiler.io.artifact import load_artifact

    ma, mb = load_artifact(a).model, load_artifact(b).model
    ids = torch.randint(0, ma.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return bool(torch.equal(ma(ids), mb(ids)))


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="8,16,32")
    p.add_argument("--limit", default="640MiB", help="the cgroup memory limit of the bigger-than-footprint compiles")
    p.add_argument("--big-layers", type=int, default=BIG_LAYERS)
    p.add_argument("--big-pipelines", default="fp8-weights", help=f"of {', '.join(PIPELINES)}")
    p.add_argument("--work", type=Path, default=Path("/tmp/qcompile-streaming-bench"))
    p.add_argument("--json", "--output-json", type=Path, default=ROOT / "docs/data/streaming_memory.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model"), p.add_argument("--out"), p.add_argument("--pipeline")
    p.add_argument("--streaming"), p.add_argument("--corpus"), p.add_argument("--memory-limit", type=int)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    from calib import load_corpus_text
    from compiler.pipeline.memory import parse_size

    args.work.mkdir(parents=True, exist_ok=True)
    args.corpus = str(args.work / "corpus.txt")
    Path(args.corpus).write_text(load_corpus_text("pydoc")[:60_000])
    tokenizer = make_tokenizer(args.work / "tokenizer")
    depths = [int(d) for d in args.depths.split(",") if d]  # --depths "": only the bigger-than-footprint runs
    rows = []
    for n in depths:
        model = args.work / f"llama-{n}"
        size = make_checkpoint(model, n, tokenizer)
        for streaming in ("on", "off"):
            r = run_child(args, model, args.work / f"awq-{n}-{streaming}", "awq", streaming)
            rows.append({"layers": n, "checkpoint_bytes": size, "streamed": streaming == "on", **r})
            print(json.dumps(rows[-1]), flush=True)
        rows[-2]["same_tensors_as_in_memory"] = same_tensors(args.work / f"awq-{n}-on", args.work / f"awq-{n}-off")
    rows.sort(key=lambda r: (r["layers"], not r["streamed"]))
    streamed = [r["peak_rss_bytes"] for r in rows if r["streamed"] and "peak_rss_bytes" in r]
    spread = max(streamed) / min(streamed) - 1 if streamed else None

    limit = parse_size(args.limit)
    big = args.work / f"llama-{args.big_layers}"
    big_size = make_checkpoint(big, args.big_layers, tokenizer)
    cgroup = make_cgroup(limit)
    limited = []
    try:
        for pipeline in args.big_pipelines.split(","):
            reference = args.work / f"{pipeline}-{args.big_layers}-off"
            limited_ref = run_child(args, big, reference, pipeline, "off")
            out = args.work / f"{pipeline}-{args.big_layers}-limited"
            r = run_child(args, big, out, pipeline, "on", cgroup, limit)
            if "failed" not in r:
                r |= {"same_tensors_as_in_memory": same_tensors(out, reference),
                      "same_logits_as_in_memory": same_logits(out, reference)}
            limited.append({"pipeline": pipeline, **r, "in_memory": limited_ref})
            print(json.dumps(limited[-1]), flush=True)
        refusal = run_child(args, big, args.work / "refused", "awq", "off", None, limit)
    finally:
        if cgroup is not None:
            cgroup.rmdir()
    result = {"width": WIDTH, "calibration": CALIBRATION, "pipelines": PIPELINES, "depth": rows,
              "streamed_peak_spread": spread, "limit_bytes": limit, "cgroup": str(cgroup) if cgroup else None,
              "big_layers": args.big_layers, "checkpoint_bytes": big_size, "limited": limited,
              "in_memory_at_limit": refusal}
    print_table(result)
    return write_result(args.json, result.pop("depth"), **result)


def print_table(result: dict) -> None:
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print("| layers | checkpoint MiB | compile | peak RSS MiB | planned MiB | wall s |")
    print("|---|---|---|---|---|---|")
    for r in result["depth"]:
        print(f"| {r['layers']} | {mib(r['checkpoint_bytes'])} | {'streamed' if r['streamed'] else 'in memory'} | "
              f"{mib(r.get('peak_rss_bytes', 0))} | {mib(r.get('planned_bytes', 0))} | {r.get('wall_s', '-')} |")
    if result["streamed_peak_spread"] is not None:
        print(f"streamed peak spread across depths: {100 * result['streamed_peak_spread']:.1f}%")
    for r in result["limited"]:
        print(f"{r['pipeline']} streamed under a {mib(result['limit_bytes'])} MiB cgroup "
              f"({mib(result['checkpoint_bytes'])} MiB checkpoint): {r}")
    print(f"in memory at that limit: {result['in_memory_at_limit']}")


if __name__ == "__main__":
    main()
