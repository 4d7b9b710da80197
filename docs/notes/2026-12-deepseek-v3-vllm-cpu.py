"""Does vLLM's CPU build run DeepSeek-V3 as transformers does? (Why ``--target vllm`` refuses it.)

A one-off probe, kept beside its study (2026-12-deepseek-v3-vllm-cpu.md); it was
benchmarks/vllm_deepseek_probe.py until issue 46 (last there at commit 64101ec).

Tiny random DeepSeek-V3 checkpoints (``tests/arch_helpers.py``; MLA with kv_lora_rank 512 and a
64-wide rope part, the one latent width vLLM 0.32's CPU MLA kernel takes), one with its MoE layer
and one with dense layers only, run in float32 by transformers and by vLLM (``.venv-vllm``, CPU_MLA
attention, eager): the prompt log-probabilities of one 10-token prompt, and 12 greedy tokens after
prompts of 1, 2 and 6 tokens.

    python docs/notes/2026-12-deepseek-v3-vllm-cpu.py   # prints the comparison; --output-json FILE keeps every figure

Two config keys transformers' DeepseekV3Config does not write are added (vLLM reads them, and
without them routes by softmax and fails on ``e_score_correction_bias``): ``topk_method = "noaux_tc"``,
``scoring_func = "sigmoid"``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROMPT = [5, 17, 33, 90, 41, 7, 100, 3, 250, 12]
GREEDY_PROMPTS = [[5], [5, 17], [5, 17, 33, 90, 41, 7]]
GREEDY_TOKENS = 12
MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, qk_rope_head_dim=64,
           qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64)
CHECKPOINTS = {"moe": {}, "dense only": {"first_k_dense_replace": 3}}


def make_checkpoint(path: Path, overrides: dict) -> None:
    from arch_helpers import make_arch_model
    from conftest import make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    model = make_arch_model("deepseek-v3", vocab_size=len(tokenizer), **MLA, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(config, indent=1))


def transformers_run(path: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(p):].tolist()
                  for p in GREEDY_PROMPTS]
    return {"prompt_logprobs": [logprobs[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], "greedy": greedy}


def vllm_child(path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256,
              attention_config={"backend": "CPU_MLA"})  # the default, AMX_MLA, takes bfloat16 only
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    logprobs = [d[PROMPT[i]].logprob for i, d in enumerate(out[0].prompt_logprobs) if i > 0]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in GREEDY_PROMPTS],
                        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))
    print("RESULT " + json.dumps({"prompt_logprobs": logprobs, "greedy": [list(o.outputs[0].token_ids) for o in outs]}))


def vllm_run(path: Path, log: Path) -> dict:
    from backends.vllm.runtime import CPU_ENV, DROPPED_ENV, OFFLINE_ENV

    env = {**{k: v for k, v in os.environ.items() if k not in DROPPED_ENV}, **CPU_ENV, **OFFLINE_ENV}
    proc = subprocess.run([str(VLLM_PYTHON), __file__, "--vllm-child", str(path)], capture_output=True, text=True,
                          env=env, timeout=900)
    log.write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"vLLM failed on {path} (exit {proc.returncode}); its log: {log}")
    return json.loads(lines[-1][len("RESULT "):])


def compare(ref: dict, got: dict) -> dict:
    diffs = [abs(a - b) for a, b in zip(ref["prompt_logprobs"], got["prompt_logprobs"])]
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
             for r, g in zip(ref["greedy"], got["greedy"])]
    return {"logprob_abs_diff_position_1": diffs[0], "logprob_abs_diff_positions_2_on_max": max(diffs[1:]),
            "greedy_tokens_agreeing": {len(p): n for p, n in zip(GREEDY_PROMPTS, agree)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-json", type=Path)
    p.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vllm_child:
        return vllm_child(args.vllm_child)
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"vLLM is not installed at {VLLM_PYTHON}; run scripts/setup_vllm.sh")
    results = {}
    with tempfile.TemporaryDirectory(prefix="qcompile-deepseek-") as work:
        for name, overrides in CHECKPOINTS.items():
            path = Path(work) / name.replace(" ", "-")
            make_checkpoint(path, overrides)
            ref, got = transformers_run(path), vllm_run(path, Path(work) / f"{path.name}.log")
            summary = compare(ref, got)
            results[name] = {"transformers": ref, "vllm": got, **summary}
            print(f"{name}: " + json.dumps(summary))
    if args.output_json:
        args.output_json.write_text(json.dumps({"prompt": PROMPT, "greedy_prompts": GREEDY_PROMPTS, "mla": MLA,
                                                "checkpoints": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
