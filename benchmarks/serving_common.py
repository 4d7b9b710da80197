"""Shared helpers of the serving benchmarks: the model, prompts from the corpus, an HF twin."""
from __future__ import annotations

import time

import torch

from calib import load_corpus_text


def load_model(spec: str):
    """A checkpoint or artifact (``smollm2`` is the built-in SmolLM2-135M)."""
    from compiler.io.load import load_checkpoint

    return load_checkpoint(spec)


def corpus_prompts(tokenizer, n: int, length: int, offset: int = 0) -> list[list[int]]:
    """``n`` distinct ``length``-token prompts cut from consecutive stretches of the pydoc corpus."""
    ids = tokenizer(load_corpus_text("pydoc")[: 400_000], add_special_tokens=False)["input_ids"]
    if (n + offset) * length > len(ids):
        raise ValueError("corpus too short for that many prompts")
    return [ids[(offset + i) * length:(offset + i + 1) * length] for i in range(n)]


def hf_twin(model):
    """transformers' LlamaForCausalLM holding the same weights (the baseline for ``generate``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    if c.architecture != "LlamaForCausalLM":
        raise ValueError("the HF baseline is built for Llama checkpoints only")
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
        raise RuntimeError(f"HF twin does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(next(model.parameters()).dtype)


@torch.inference_mode()
def hf_generate_one_at_a_time(hf, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Greedy ``generate`` per prompt, sequentially: (seconds, output tokens, outputs)."""
    outs, start = [], time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return time.perf_counter() - start, sum(len(o) for o in outs), outs


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once, step to completion; throughput, TTFT and the outputs."""
    from serving.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    rids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    reqs = [engine.requests[r] for r in rids]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    ttfts = [r.metrics.ttft_s for r in reqs]
    return {"seconds": elapsed, "output_tokens": sum(len(r.output_token_ids) for r in reqs), "steps": steps,
            "ttft_mean_s": sum(ttfts) / len(ttfts), "outputs": [r.output_token_ids for r in reqs]}
