"""The paged engine on Qwen3, Gemma 3 (per-layer sliding windows, soft-capped logits), Qwen3-MoE,
Mixtral and DeepSeek-V3 (its latent KV cache): greedy tokens under continuous batching equal the contiguous-cache reference (itself equal
to transformers, tests/compiler/model/test_arch_parity.py), and the logits it samples from are the
model's own."""
from __future__ import annotations

import pytest
import torch
from arch_helpers import make_arch_model

import serving.request
from compiler.io.load import load_checkpoint
from serving.engine import Engine
from serving.types import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def load_case(case, tmp_path):
    make_arch_model(case).save_pretrained(tmp_path / case)
    return load_checkpoint(tmp_path / case, with_tokenizer=False)


def prompts_of(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_staggered(engine, prompts, params=GREEDY, every=2):
    rids, outs, pending, step = [], {}, list(prompts), 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            rids.append(engine.add_request(prompt_token_ids=pending.pop(0), params=params))
        for rid, ev in engine.step().items():
            outs.setdefault(rid, []).extend(ev.token_ids)
        step += 1
    return [outs[r] for r in rids]


ENGINE_CASES = ["qwen3", "gemma3", "gemma3-scalar-linear-rope-softcap", "qwen3-moe", "mixtral-sliding", "deepseek-v3",
                "deepseek-v3-q-proj-yarn"]


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_greedy_matches_reference(case, tmp_path):
    loaded = load_case(case, tmp_path)
    prompts = prompts_of([5, 17, 9, 30, 1, 12])
    prompts.append(prompts[1][:12] + [7, 8, 9])  # shares a prefix (3 blocks) with prompt 1
    want = [loaded.model.generate(torch.tensor([p]), GREEDY.max_tokens)[0, len(p):].tolist() for p in prompts]
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=96, max_num_batched_tokens=16)
    assert run_staggered(engine, prompts) == want
    assert engine.kv.num_free_blocks == 96
    assert engine.scheduler.stats.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("case", ["gemma3-scalar-linear-rope-softcap", "qwen3-moe", "deepseek-v3"])
def test_engine_samples_from_the_models_logits(case, tmp_path, monkeypatch):
    """What the sampler sees (soft-capped for Gemma) is the model's last-position logits."""
    loaded = load_case(case, tmp_path)
    seen = []
    sample = serving.request.sample_token
    monkeypatch.setattr(serving.request, "sample_token", lambda logits, *a: seen.append(logits) or sample(logits, *a))
    prompt = prompts_of([20])[0]
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=32)
    engine.generate(prompt_token_ids=prompt, max_tokens=3, temperature=0.8, seed=0)
    with torch.no_grad():
        want = loaded.model(torch.tensor([prompt]))[0, -1]
    assert torch.allclose(seen[0], want, rtol=1e-5, atol=1e-5)
    if loaded.model.config.final_logit_softcapping:
        assert seen[0].abs().max() <= loaded.model.config.final_logit_softcapping


def test_deepseek_caches_its_latent_not_keys_and_values(tmp_path):
    """MLA's paged cache holds one kv_lora_rank + qk_rope_head_dim vector per token and layer, no V:
    its blocks cost that, and what a prompt leaves in it is the model's own latent."""
    loaded = load_case("deepseek-v3", tmp_path)
    c = loaded.model.config
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=8)
    spec = engine.cache.spec
    assert (spec.num_kv_heads, spec.head_dim, spec.keys_only) == (1, c.kv_lora_rank + c.head_dim, True)
    assert engine.cache.v == []
    assert spec.bytes_per_block == c.n_layers * 4 * (c.kv_lora_rank + c.head_dim) * 4  # fp32, K alone
    prompt = prompts_of([6])[0]
    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill: 6 latents written
    slots = [b * 4 + o for b in engine.kv.block_ids(rid) for o in range(4)][:6]
    attn = loaded.model.layers[0].self_attn
    with torch.no_grad():
        x = loaded.model.layers[0].input_layernorm(loaded.model.embed_tokens(torch.tensor([prompt])))
        c_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., : c.kv_lora_rank])[0]  # [6, r]
    stored = engine.cache.k[0].view(-1, spec.head_dim)[slots]
    assert torch.allclose(stored[:, : c.kv_lora_rank], c_kv, atol=1e-6)
