"""The engine end to end on tiny random models: greedy parity with the contiguous-cache reference
under continuous batching (staggered arrivals, chunked prefill, prefix caching, preemption),
seeded sampling, stop conditions, cancel, bad requests, artifacts (float, FP8 KV, INT8 KV, a
quantized test double)."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from artifact_helpers import rewrite_manifest

from compiler.io.load import load_checkpoint
from compiler.model.kv_cache import ContiguousKVCache
from serving.engine import Engine
from serving.request import RequestError
from serving.types import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture
def tiny_model(tiny_checkpoint):
    def make(arch="llama", **overrides):
        path, _ = tiny_checkpoint(arch, **overrides)
        return load_checkpoint(path)

    return make


def prompts_of(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens)
    return out[0, len(prompt):].tolist()


def run_staggered(engine, prompts, params=GREEDY, every=2):
    """Submit one prompt every ``every`` steps while stepping; return each request's tokens in order."""
    rids, outs, pending, step = [], {}, list(prompts), 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            rids.append(engine.add_request(prompt_token_ids=pending.pop(0), params=params))
        for rid, ev in engine.step().items():
            outs.setdefault(rid, []).extend(ev.token_ids)
        step += 1
    return [outs[r] for r in rids]


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_reference_with_staggered_arrivals(tiny_model, arch, overrides, caching):
    loaded = tiny_model(arch, **overrides)
    prompts = prompts_of([5, 17, 9, 30, 1, 12])
    prompts.append(prompts[1][:12] + [7, 8, 9])  # shares a prefix (3 blocks) with prompt 1
    want = [reference(loaded.model, p, GREEDY.max_tokens) for p in prompts]
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=96, max_num_batched_tokens=16,
                                enable_prefix_caching=caching)
    assert run_staggered(engine, prompts) == want
    assert engine.kv.num_free_blocks == 96  # everything returned
    cached = engine.scheduler.stats.num_cached_prompt_tokens
    assert (cached > 0) == caching


@pytest.mark.parametrize("pack", [True, False])
def test_packed_cpu_weights_keep_greedy_outputs(tiny_model, pack):
    loaded = tiny_model()
    prompts = prompts_of([5, 17, 9, 30])
    want = [reference(loaded.model, p, GREEDY.max_tokens) for p in prompts]
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=96, pack_cpu_weights=pack)
    packed = engine.load_report.packing.get("packed", [])
    # every float projection of the tiny llama (fused q/k/v and gate/up, o, down) and the head
    assert len(packed) == (4 * engine.config.n_layers + 1 if pack else 0), packed
    assert run_staggered(engine, prompts, every=1) == want


def test_preemption_recomputes_and_keeps_outputs(tiny_model):
    loaded = tiny_model()
    prompts = prompts_of([10, 14, 7, 11, 9], seed=1)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [reference(loaded.model, p, 20) for p in prompts]
    # 12 blocks of 4 = 48 slots for 5 requests that need up to 34 tokens each: someone must be preempted.
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=12, max_num_batched_tokens=32)
    got = run_staggered(engine, prompts, params, every=1)
    assert engine.scheduler.stats.num_preemptions > 0
    assert got == want
    assert engine.kv.num_free_blocks == 12


def test_full_prefix_hit_uses_copy_on_write(tiny_model):
    loaded = tiny_model()
    (prompt,) = prompts_of([16], seed=2)  # exactly 4 blocks of 4
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=32)
    first = run_staggered(engine, [prompt])
    copies = []
    original = engine.cache.copy_blocks
    engine.cache.copy_blocks = lambda c: (copies.extend(c), original(c))
    second = run_staggered(engine, [prompt])
    assert first == second == [reference(loaded.model, prompt, GREEDY.max_tokens)]
    assert len(copies) == 1  # the last block, rewritten by the recomputed last prompt token
    assert engine.scheduler.stats.num_cached_prompt_tokens == 15


def test_chunked_prefill_respects_the_token_budget(tiny_model):
    loaded = tiny_model()
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64, max_num_batched_tokens=8)
    for p in prompts_of([20, 3, 11]):
        engine.add_request(prompt_token_ids=p, params=GREEDY)
    sizes = []
    while engine.has_unfinished():
        sched_before = engine.scheduler.stats.num_computed_tokens
        engine.step()
        sizes.append(engine.scheduler.stats.num_computed_tokens - sched_before)
    assert max(sizes) <= 8 and sizes[0] == 8


def test_seeded_sampling_is_reproducible_alone_or_batched(tiny_model):
    loaded = tiny_model()
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64)
    (p, other) = prompts_of([6, 9], seed=3)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=123, ignore_eos=True)
    alone = run_staggered(engine, [p], params)[0]
    batched = run_staggered(engine, [other, p, other], params, every=1)[1]
    assert alone == batched
    different = run_staggered(engine, [p], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert different != alone


def test_sampling_params_or_their_fields_as_keywords_are_one_request(tiny_model):
    engine = Engine.from_loaded(tiny_model(), "cpu", block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, top_p=0.9, seed=4, ignore_eos=True)
    by_params = engine.generate(prompt_token_ids=[5, 6, 7], params=params).token_ids
    assert engine.generate(prompt_token_ids=[5, 6, 7], max_tokens=6, temperature=0.9, top_k=20, top_p=0.9, seed=4,
                           ignore_eos=True).token_ids == by_params
    assert SamplingParams(stop="\n").stop == ("\n",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_eos_and_ignore_eos(tiny_model):
    loaded = tiny_model()
    (p,) = prompts_of([8], seed=4)
    ref = reference(loaded.model, p, 30)
    eos = ref[5]
    loaded.model.config.eos_token_id = eos
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64)
    stopped = engine.generate(prompt_token_ids=p, max_tokens=30)
    assert stopped.token_ids == ref[:ref.index(eos) + 1] and stopped.finish_reason == "stop"
    full = engine.generate(prompt_token_ids=p, max_tokens=30, ignore_eos=True)
    assert full.token_ids == ref and full.finish_reason == "length"


def test_stop_strings_and_text_deltas(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer()
    loaded = load_checkpoint(path)
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64)
    full = engine.generate(prompt="def f(x):", max_tokens=24, ignore_eos=True)
    assert full.text == loaded.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[6:9]
    assert stop

    async def stream():
        return [e async for e in engine.generate_stream(prompt="def f(x):", max_tokens=24, ignore_eos=True, stop=[stop])]

    events = asyncio.run(stream())
    text = "".join(e.text for e in events)
    assert text == full.text[:full.text.find(stop)] and stop not in text
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])


def test_async_streams_run_concurrently_and_break_aborts(tiny_model):
    loaded = tiny_model()
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64)
    prompts = prompts_of([4, 9, 13], seed=5)

    async def consume(p, limit=None):
        ids = []
        async for e in engine.generate_stream(prompt_token_ids=p, max_tokens=12, ignore_eos=True):
            ids += e.token_ids
            if limit and len(ids) >= limit:
                break  # leaving the loop aborts the request
        return ids

    async def main():
        return await asyncio.gather(consume(prompts[0]), consume(prompts[1], limit=3), consume(prompts[2]))

    a, b, c = asyncio.run(main())
    assert a == reference(loaded.model, prompts[0], 12) and c == reference(loaded.model, prompts[2], 12)
    assert b == reference(loaded.model, prompts[1], 12)[:3]
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == 64


def test_abort_frees_blocks_and_others_go_on(tiny_model):
    loaded = tiny_model()
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64)
    p, q = prompts_of([10, 6], seed=6)
    a = engine.add_request(prompt_token_ids=p, params=GREEDY)
    b = engine.add_request(prompt_token_ids=q, params=GREEDY)
    engine.step()
    engine.step()
    assert engine.abort(a).finish_reason == "abort"
    assert engine.abort(a) is None
    out = []
    while engine.has_unfinished():
        out += engine.step().get(b, None).token_ids
    assert engine.kv.num_free_blocks == 64
    assert len(out) == GREEDY.max_tokens - 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_token_ids=[]), "empty"),
    (dict(prompt_token_ids=[1] * 250, max_tokens=10), "exceeds the model's max_seq_len"),
    (dict(prompt_token_ids=[5, 999]), "outside the vocabulary"),
    (dict(prompt="hi"), "no tokenizer"),
    (dict(prompt_token_ids=[1], temperature=-1.0), "temperature"),
    (dict(prompt_token_ids=[1], top_p=0.0), "top_p"),
    (dict(prompt_token_ids=[1], stop=["x"]), "tokenizer"),
    (dict(), "exactly one"),
    (dict(prompt_token_ids=[1], temprature=0.5), "unknown sampling setting 'temprature'"),
    (dict(prompt_token_ids=[1], params=GREEDY, max_tokens=3), "not both"),
])
def test_bad_requests_are_rejected_and_others_go_on(tiny_model, kwargs, match):
    loaded = tiny_model()
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=64)
    good = engine.add_request(prompt_token_ids=[5, 6, 7], params=GREEDY)
    with pytest.raises(RequestError, match=match):
        engine.generate(**kwargs)
    assert good in engine.requests


def test_request_larger_than_the_cache_is_rejected(tiny_model):
    engine = Engine.from_loaded(tiny_model(), "cpu", block_size=4, num_blocks=4)  # 16 slots
    with pytest.raises(RequestError, match="KV cache's capacity of 16"):
        engine.generate(prompt_token_ids=[1] * 10, max_tokens=7)
    assert len(engine.generate(prompt_token_ids=[1] * 10, max_tokens=6, ignore_eos=True).token_ids) == 6


def _compile(path, out, passes):
    import passes as _  # noqa: F401  (registers paged_kv)
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    return compile_model(path, PipelineConfig.from_dict({"passes": passes}), out).path


def test_artifact_plan_and_fp8_kv_cache(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint()
    art = _compile(path, tmp_path / "art", [{"name": "paged_kv", "block_size": 8, "num_blocks": 40}])
    engine = Engine.from_artifact(art, "cpu")
    assert engine.cache.spec.block_size == 8 and engine.cache.spec.num_blocks == 40
    prompts = prompts_of([7, 19, 3], seed=8)
    want = [reference(engine.model, p, 12) for p in prompts]
    assert run_staggered(engine, prompts) == want
    # An FP8 KV-cache entry as the fp8 pass writes it (per-head scales).
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_head",
                            "k_scale": [[0.02, 0.03], [0.025, 0.025]], "v_scale": [[0.01, 0.01], [0.012, 0.012]]}
    manifest["serving"]["kv_dtype"] = "auto"
    rewrite_manifest(art, manifest)
    fp8 = Engine.from_artifact(art, "cpu")
    assert fp8.cache.k[0].dtype == torch.float8_e4m3fn
    k_scales = [torch.tensor([0.02, 0.03]), torch.tensor([0.025, 0.025])]
    v_scales = [torch.tensor([0.01, 0.01]), torch.tensor([0.012, 0.012])]
    want_fp8 = [reference_with_cache(fp8.model, p, 12, FP8RoundTripCache(fp8.model, len(p) + 12, k_scales, v_scales))
                for p in prompts]
    assert run_staggered(fp8, prompts) == want_fp8
    # A float32 cache for the same artifact keeps the model's own FP8 K/V rounding (the FP8 cache
    # above drops it, storing the same codes): the same tokens either way.
    float_cache = Engine.from_artifact(art, "cpu", kv_dtype="float32")
    assert float_cache.cache.k[0].dtype == torch.float32 and float_cache.model.layers[0].self_attn.kv_quant is not None
    assert run_staggered(float_cache, prompts) == want_fp8


@torch.no_grad()
def test_int8_kv_artifact_serves_the_models_own_tokens(tiny_checkpoint_with_tokenizer, tmp_path):
    """An INT8-KV artifact compiled by the int8 pass: the paged_kv pass plans an int8 cache, the engine
    stores int8 codes and drops the model's K/V rounding hook (the cache quantizes as it does), so its
    greedy tokens under continuous batching are the loaded model's own, and its report says so."""
    import passes  # noqa: F401  (registers the int8 and paged_kv passes)
    from compiler.errors import ConfigError, QCompileError
    from compiler.formats.kv_quant import Int8KVQuant
    from compiler.io.artifact import load_artifact
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model
    from serving.engine_setup import describe_kernels

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    calib = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}
    int8 = {"name": "int8", "smoothing_strength": 0.5, "kv_cache_dtype": "int8"}
    art = compile_model(path, PipelineConfig.from_dict({"calibration": calib, "passes": [
        int8, {"name": "paged_kv", "block_size": 8}]}), tmp_path / "art").path
    model = load_artifact(art).model
    assert isinstance(model.layers[0].self_attn.kv_quant, Int8KVQuant)
    prompts = prompts_of([7, 19, 3, 26], seed=9)
    want = [reference(model, p, 12) for p in prompts]
    engine = Engine.from_artifact(art, "cpu")
    assert engine.plan.kv_dtype == "int8" and engine.cache.spec.dtype == torch.int8
    assert engine.cache.k_scales[0].shape == (model.config.n_kv_heads, model.config.head_dim)
    assert engine.model.layers[0].self_attn.kv_quant is None
    assert "KV cache int8 codes with the artifact's scales, dequantized on read" in describe_kernels(
        engine.load_report.kernels)
    assert run_staggered(engine, prompts) == want
    float_cache = Engine.from_artifact(art, "cpu", kv_dtype="float32")  # keeps the hook: no memory saving
    assert ("KV cache int8 K/V rounded by the model's kv_quant hook, stored in float32 blocks (no memory saving)"
            in describe_kernels(float_cache.load_report.kernels))
    for layer in model.layers:  # the rounding changes these tokens: the parity above is the INT8 cache's
        layer.self_attn.kv_quant = None
    assert [reference(model, p, 12) for p in prompts] != want
    # an FP8 cache cannot hold it (its scales are not FP8 ones): refused in one line
    with pytest.raises(ConfigError, match="kv_dtype float8_e4m3fn needs K/V scales calibrated for it .* the "
                                          "artifact's KV cache is int8") as err:
        Engine.from_artifact(art, "cpu", kv_dtype="float8_e4m3fn")
    assert "\n" not in str(err.value)
    with pytest.raises(QCompileError, match=r"\(paged_kv\): requires fp8_kv_cache"):  # before any pass runs
        compile_model(path, PipelineConfig.from_dict({"calibration": calib, "passes": [
            int8, {"name": "paged_kv", "kv_dtype": "float8_e4m3fn"}]}), tmp_path / "b")


class FP8RoundTripCache(ContiguousKVCache):
    """Test double: the contiguous reference cache, storing K/V as they come back from FP8."""

    def __init__(self, model, max_len, k_scales, v_scales):
        c = model.config
        super().__init__(c.n_layers, 1, max_len, c.n_kv_heads, c.head_dim)
        self.k_scales, self.v_scales = k_scales, v_scales

    @staticmethod
    def _roundtrip(x, scale):
        s = scale.reshape(1, -1, 1, 1)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    def attend(self, layer_idx, q, k, v, positions):
        k = self._roundtrip(k, self.k_scales[layer_idx])
        v = self._roundtrip(v, self.v_scales[layer_idx])
        return super().attend(layer_idx, q, k, v, positions)


@torch.no_grad()
def reference_with_cache(model, prompt, n, cache):
    """Greedy decoding one request at a time through ``cache`` (like ``Transformer.generate``)."""
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    out = []
    for step in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + step]]), cache)
    return out


def test_fp8_kv_without_scales_is_refused(tiny_checkpoint, tmp_path):
    from compiler.errors import ArtifactError, QCompileError

    path, _ = tiny_checkpoint()
    with pytest.raises(QCompileError, match="requires fp8_kv_cache"):
        _compile(path, tmp_path / "a", [{"name": "paged_kv", "kv_dtype": "float8_e4m3fn"}])
    art = _compile(path, tmp_path / "b", [])
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_tensor", "k_scale": [0.1], "v_scale": [0.1, 0.1]}
    rewrite_manifest(art, manifest)
    with pytest.raises(ArtifactError, match="k_scale must hold 2 layers × 1 positive scales"):
        Engine.from_artifact(art, "cpu")


class FakeInt8Linear(torch.nn.Module):
    """Test double for a quantized layer: per-row int8 weights dequantized in forward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.register_buffer("scale", w.abs().amax(1, keepdim=True) / 127)
        self.register_buffer("q", torch.round(w / self.scale).to(torch.int8))
        self.bias = linear.bias

    def forward(self, x):
        return torch.nn.functional.linear(x, self.q.float() * self.scale, self.bias)


def test_quantized_layers_need_nothing_engine_specific(tiny_model):
    loaded = tiny_model()
    for layer in loaded.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, FakeInt8Linear(getattr(layer.self_attn, name)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, name, FakeInt8Linear(getattr(layer.mlp, name)))
    prompts = prompts_of([6, 15], seed=9)
    want = [reference(loaded.model, p, 12) for p in prompts]
    engine = Engine.from_loaded(loaded, "cpu", block_size=4, num_blocks=32)
    assert run_staggered(engine, prompts) == want


def test_a_failing_step_fails_every_stream_loudly(tiny_model):
    engine = Engine.from_loaded(tiny_model(), "cpu", block_size=4, num_blocks=32)

    def broken(*args):
        raise RuntimeError("device lost")

    engine.runner._forward = broken

    async def consume():
        return [e async for e in engine.generate_stream(prompt_token_ids=[5, 6], max_tokens=4)]

    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(consume())
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == 32


def test_bad_plan_overrides_are_config_errors(tiny_model):
    from compiler.errors import ConfigError

    with pytest.raises(ConfigError, match="block_size"):
        Engine.from_loaded(tiny_model(), "cpu", block_size=0)
