"""Distillation figures on the built-in SmolLM2-135M (issue 8). Run from the repository root:

    python benchmarks/distill_smollm2.py qat --steps 200            # AWQ INT4 g128-fallback student, QAT by KD
    python benchmarks/distill_smollm2.py half --steps 100           # half-depth student: KD vs CE-only
    python benchmarks/distill_smollm2.py memory --steps 4           # tokens/s and peak memory, with/without checkpointing

Held-out text: the pydoc evaluation region (the training corpus's last 30%, never trained on) and
the built-in corpus "stdlib-docs" (calib/corpus.py: the docstrings of a fixed list of standard-library
modules, present on any CPython 3.11; never trained on, its evaluation region is used). With
--train-docs the QAT run also trains on the pool of numpy's docstrings. Results are written as JSON
under --out (``benchmarks/common.py``'s result format, the run's figures as its one row) and printed as
one JSON line. ``--model`` names another teacher (a built-in model or a checkpoint path).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.formats.qlinear import linear_modules  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from passes.distill import DistillOptions, run_distillation  # noqa: E402
from passes.distill.api import heldout_sets  # noqa: E402
from passes.distill.students import keep_layers_student  # noqa: E402

# Training text beside the pydoc pool (--train-docs): the docstrings of numpy, which ships with
# qcompile's own numpy dependency; its pool is trained on, as pydoc's is.
# docs/notes/2026-12-distill-real-docs-text.md gives its n-gram overlap with both held-out regions.
NUMPY_MODULES = ("numpy", "numpy.linalg", "numpy.random", "numpy.fft", "numpy.polynomial")


def package_docs_corpus(path: Path, modules: tuple[str, ...]) -> str:
    """Every public callable's docstring in ``modules`` (their package's own, C-implemented ones and
    class members too; each text once) -> a .txt corpus spec."""
    parts, seen = [], set()

    def add(label: str, obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            parts.append(f"{label}\n{doc}")

    for name in modules:
        module, package = importlib.import_module(name), name.split(".")[0]
        add(name, module)
        for attr, obj in sorted(vars(module).items()):
            owner = getattr(obj, "__module__", None) or type(obj).__module__
            if attr.startswith("_") or not callable(obj) or not owner.startswith(package):
                continue
            add(attr, obj)
            if inspect.isclass(obj):
                for member, value in sorted(vars(obj).items()):
                    if not member.startswith("_") and (callable(value) or isinstance(value, property)):
                        add(f"{attr}.{member}", value)
    return _write_corpus(path, parts)


def heldout_overlap(tokenizer, train: str, heldout: dict[str, torch.Tensor], n: int = 13) -> dict[str, float]:
    """For each held-out set ([windows, T] token ids): the fraction of its ``n``-grams that occur in
    ``train``'s pool (a contamination check; 13-grams as in GPT-3's)."""
    from passes.distill.data import corpus_tokens

    def grams(ids: list[int]) -> list[tuple]:
        return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]

    seen = set(grams(corpus_tokens(tokenizer, train).pool.tolist()))
    rows = {name: [g for w in windows.tolist() for g in grams(w)] for name, windows in heldout.items()}
    return {name: sum(g in seen for g in gs) / len(gs) for name, gs in rows.items()}


def _write_corpus(path: Path, parts: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("\n\n".join(p for p in parts if p))
    os.replace(tmp, path)  # concurrent runs never read a half-written file
    return str(path)


def int4_student(teacher, group_size: int = 128, fallback: int = 64):
    """RTN INT4 of every projection (lm_head, tied to the embedding, stays float); g128, or g64 where K % 128 != 0."""
    student = copy.deepcopy(teacher)
    for name, m in linear_modules(student).items():
        if name != "lm_head":
            g = group_size if m.in_features % group_size == 0 else fallback
            student.set_submodule(name, Int4Linear.from_float(m, g))
    return student


def awq_student(teacher, tokenizer, samples: int, seq_len: int):
    """The AWQ pass (g128, group_size_policy "fallback": g64 where 128 does not divide K; lm_head float)."""
    import passes  # noqa: F401  (registers awq)
    from compiler.pipeline import PassContext, Pipeline, PipelineConfig

    config = PipelineConfig.from_dict({"calibration": {"samples": samples, "seq_len": seq_len},
                                       "passes": [{"name": "awq", "group_size": 128, "group_size_policy": "fallback"}]})
    student = copy.deepcopy(teacher)
    pipeline = Pipeline(config)
    pipeline.validate(student.config)
    pipeline.run(student, PassContext(tokenizer=tokenizer, calibration=config.calibration))
    return student


def _options(args, out: Path, **kw) -> DistillOptions:
    return DistillOptions(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=kw.pop("lr", args.lr),
                          eval_windows=args.eval_windows, eval_len=args.eval_len, heldout=[args.second],
                          checkpoint_every=0, output_dir=str(out), freeze_embeddings=True, **kw)


def run_qat(args, teacher, tokenizer) -> dict:
    if args.student == "awq":
        student = awq_student(teacher, tokenizer, args.awq_samples, args.awq_seq_len)
        label = f"AWQ INT4 g128 fallback (calibration {args.awq_samples} x {args.awq_seq_len} pydoc-pool tokens)"
    else:
        student, label = int4_student(teacher), "RTN INT4 g128 (g64 fallback)"
    train = [package_docs_corpus(args.out / "numpy-docs.txt", NUMPY_MODULES)] if args.train_docs else []
    opts = _options(args, args.out / "qat", learn_qparams=args.learn_qparams, beta=args.beta,
                    block_epochs=args.block_epochs, block_sequences=args.block_sequences, block_lr=args.block_lr,
                    generated_sequences=args.generated_sequences, e2e_params=args.e2e_params, train_corpora=train)
    overlap = {c: heldout_overlap(tokenizer, c, heldout_sets(tokenizer, opts)) for c in train}
    outcome = run_distillation(teacher, student, tokenizer, opts, args.out / "qat")
    return {"student": f"{label}, lm_head float; embeddings frozen", "heldout_13gram_overlap": overlap, **outcome.metrics}


def run_half(args, teacher, tokenizer) -> dict:
    keep = list(range(0, teacher.config.n_layers, 2))
    results = {}
    variants = {"kd": dict(hidden_norm=args.hidden_norm), "ce_only": dict(alpha=0.0, beta=0.0, gamma=1.0)}
    for label in args.variants:
        kw = variants[label]
        student = keep_layers_student(teacher, keep)
        out = args.out / f"half-{label}"
        outcome = run_distillation(teacher, student, tokenizer, _options(args, out, lr=args.half_lr, **kw), out)
        results[label] = outcome.metrics
    return {"student": f"keep_layers {keep}", **results}


def run_memory(args, teacher, tokenizer) -> dict:
    """Each setting in a fresh process, so peak RSS is its own."""
    rows = {}
    for ckpt in (False, True):
        cmd = [sys.executable, __file__, "memory-one", "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--out", str(args.out), "--model", args.model] + (["--ckpt"] if ckpt else [])
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows["with_checkpointing" if ckpt else "without_checkpointing"] = json.loads(line)
    return rows


def run_memory_one(args, teacher, tokenizer) -> dict:
    from passes.distill.students import make_qat_student
    from passes.distill.trainer import Distiller

    student = int4_student(teacher)
    make_qat_student(student)
    # Speed and memory do not depend on which tokens: random ids skip tokenizing the corpus.
    seqs = torch.randint(0, teacher.config.vocab_size, (64, args.seq_len), generator=torch.Generator().manual_seed(0))
    opts = DistillOptions(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, checkpoint_every=0,
                          gradient_checkpointing=args.ckpt)
    saved = {"bytes": 0}

    def pack(t):  # count the activations autograd keeps for the backward pass
        saved["bytes"] += t.numel() * t.element_size()
        return t

    d = Distiller(teacher, student, seqs, opts)
    d.step()  # warm-up step, not timed
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        start = time.perf_counter()
        for _ in range(args.steps):
            d.step()
        wall = time.perf_counter() - start
    tokens = args.steps * args.batch_size * args.seq_len
    return {"gradient_checkpointing": args.ckpt, "tokens_per_s": tokens / wall, "saved_activation_mib_per_step": saved["bytes"] / args.steps / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "steps": args.steps}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("qat", "half", "memory", "memory-one"))
    p.add_argument("--model", default="smollm2", help="the teacher: a built-in model or a checkpoint path")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--half-lr", type=float, default=2e-4)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--eval-len", type=int, default=512)
    p.add_argument("--ckpt", action="store_true")
    p.add_argument("--hidden-norm", choices=("rms", "none"), default="rms", help="half: the KD run's hidden_norm")
    p.add_argument("--variants", nargs="+", choices=("kd", "ce_only"), default=["kd", "ce_only"], help="half: which runs")
    p.add_argument("--student", choices=("awq", "rtn"), default="awq", help="qat: the INT4 student to start from")
    p.add_argument("--beta", type=float, default=DistillOptions.beta, help="qat: weight of the hidden-state MSE")
    p.add_argument("--block-epochs", type=int, default=0, help="qat: block-wise reconstruction first (passes per block)")
    p.add_argument("--block-sequences", type=int, default=DistillOptions.block_sequences)
    p.add_argument("--block-lr", type=float, default=DistillOptions.block_lr)
    p.add_argument("--train-docs", action="store_true", help="qat: also train on the pool of numpy's docstrings")
    p.add_argument("--generated-sequences", type=int, default=0, help="qat: teacher-written sequences added to the pool")
    p.add_argument("--learn-qparams", action="store_true", help="qat: learn INT4 scales and zero points too")
    p.add_argument("--e2e-params", choices=("all", "scales"), default="all",
                   help="qat: what the end-to-end steps train (scales: codes fixed, EfficientQAT's E2E-QP)")
    p.add_argument("--awq-samples", type=int, default=32)
    p.add_argument("--awq-seq-len", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("out/bench-distill"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.what == "memory":  # each setting loads the model in its own process
        result = {"what": "memory", **run_memory(args, None, None)}
        print(json.dumps(result))
        return write_result(args.out / "memory.json", [result], model=args.model)
    loaded = load_checkpoint(args.model)
    args.second = "stdlib-docs" if args.what in ("qat", "half") else None
    run = {"qat": run_qat, "half": run_half, "memory-one": run_memory_one}[args.what]
    result = {"what": args.what, "args": {k: str(v) for k, v in vars(args).items()}, **run(args, loaded.model, loaded.tokenizer)}
    print(json.dumps(result))  # memory-one: the line run_memory reads
    if args.what == "memory-one":
        return result
    return write_result(args.out / f"{args.what}.json", [result], model=args.model)


if __name__ == "__main__":
    main()
