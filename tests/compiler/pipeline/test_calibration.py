"""The calibration collector against statistics computed by hand from captured inputs, the
sharing of one tensor's statistics, and the context's cache by model state."""
from dataclasses import dataclass

import pytest
import torch

from calib import CalibrationConfig
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer
from compiler.pipeline import (
    PASSES,
    Pass,
    PassContext,
    PassReport,
    Pipeline,
    PipelineConfig,
)
from compiler.pipeline.calibration import (
    InputRequest,
    StatisticsCache,
    TokenSampler,
    collect_block,
    collect_model,
)

CONFIG = ModelConfig("LlamaForCausalLM", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48)
NAMES = ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.1.mlp.down_proj")


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = Transformer(CONFIG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # RMSNorm weights off one, some channels off zero
    return m


def windows(n=6, t=16):
    return torch.randint(0, CONFIG.vocab_size, (n, t), generator=torch.Generator().manual_seed(1))


def captured_inputs(model, ids, names, batch_size):
    """Each module's flattened inputs [S*T, K], captured by plain hooks, batch by batch as the collector runs."""
    seen = {n: [] for n in names}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: seen[n].append(args[0].reshape(-1, args[0].shape[-1]))) for n in names]
    with torch.no_grad():
        for batch in ids.split(batch_size):
            model(batch)
    for h in hooks:
        h.remove()
    return {n: torch.cat(x) for n, x in seen.items()}


def test_statistics_match_their_definitions(model):
    ids = windows()
    request = InputRequest(mean_abs=True, moments=True, gram="all", token_amax=True, rows=20)
    stats = collect_model(model, ids, {n: request for n in NAMES}, batch_size=4).inputs
    x = captured_inputs(model, ids, NAMES, 4)
    for n in NAMES:
        xn, st = x[n].double(), stats[n]
        assert torch.allclose(st.mean_abs.double(), xn.abs().mean(0), rtol=1e-5)
        assert torch.allclose(st.mean, xn.mean(0)) and torch.allclose(st.mean_square, xn.square().mean(0))
        assert torch.allclose(st.hessian.double(), xn.T @ xn / len(xn), rtol=1e-4, atol=1e-6)
        assert torch.equal(st.token_amax, x[n].abs().amax(-1))
        # every 4th token (96 tokens / 20 rows), restarting at each batch of 64 tokens: 16 + 8 rows, 20 kept
        assert torch.equal(st.rows, torch.cat([x[n][0:64:4], x[n][64::4]])[:20])


def test_centred_statistics_take_the_mean_first_and_leave_outliers_out(model):
    ids = windows()
    name = "layers.1.mlp.down_proj"
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    request = InputRequest(token_amax=True, gram="all", centre=True, outlier_channels=3)
    st = collect_model(model, ids, {name: request}, batch_size=3).inputs[name]
    assert len(calls) == 2 + 2  # two forwards (moments, then the rest) of two batches each
    x = captured_inputs(model, ids, [name], 3)[name].double()
    mean = x.mean(0)
    assert torch.allclose(st.shift.double(), mean)
    assert torch.equal(st.outliers, (x - mean).square().mean(0).topk(3).indices.sort().values)
    centred = (x - st.shift.double())
    assert torch.allclose(st.hessian.double(), centred.T @ centred / len(x), rtol=1e-4, atol=1e-6)
    assert torch.allclose(st.token_amax.double(), centred.abs().index_fill(1, st.outliers, 0).amax(-1), rtol=1e-6)


def test_modules_reading_one_tensor_share_one_set_of_statistics(model):
    request = InputRequest(gram="all", token_amax=True)
    stats = collect_model(model, windows(), {n: request for n in NAMES}, batch_size=4).inputs
    q, k, down = (stats[n] for n in NAMES)
    assert q is k and q is not down  # q and k read the input_layernorm's output
    assert q.tokens == windows().numel()  # added once per batch, not once per reader
    other = collect_model(model, windows(), {NAMES[0]: request, NAMES[1]: InputRequest(token_amax=True)}).inputs
    assert other[NAMES[0]] is not other[NAMES[1]]  # different requests: each its own


def test_block_driver_builds_the_gram_on_the_seeded_sample(model):
    ids = windows()
    block = model.layers[0]
    positions = torch.arange(ids.shape[1]).expand(4, -1)
    with torch.no_grad():
        x = model.embed_tokens(ids)
        cos, sin = model.rope(positions, x.dtype)
        request = InputRequest(mean_abs=True, gram="sampled")
        out, stats = collect_block(block, x, cos, sin, positions, {"mlp.up_proj": request},
                                   TokenSampler(40, ids.numel(), torch.Generator().manual_seed(3)))
        assert torch.equal(out, torch.cat([block(x[:4], cos, sin, positions), block(x[4:], cos[:2], sin[:2], positions[:2])]))
        inputs = captured_inputs(model, ids, ["layers.0.mlp.up_proj"], 4)["layers.0.mlp.up_proj"]
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randperm(64, generator=gen)[:27], torch.randperm(32, generator=gen)[:13]  # 40 * 64 / 96 ≈ 27
    picked = torch.cat([inputs[:64][first], inputs[64:][second]])
    st = stats.inputs["mlp.up_proj"]
    assert torch.allclose(st.hessian, picked.T @ picked / len(picked), rtol=1e-4, atol=1e-6)
    assert torch.allclose(st.mean_abs, inputs.abs().mean(0), rtol=1e-5)
    with pytest.raises(ValueError, match="TokenSampler"):
        collect_block(block, x, cos, sin, positions, {"mlp.up_proj": request})


def test_cache_shares_a_forward_until_the_model_changes(model):
    cache = StatisticsCache()
    ids = windows()
    requests = {n: InputRequest(token_amax=True) for n in NAMES}
    first = collect_model(model, ids, requests, kv_heads=True, cache=cache)
    assert collect_model(model, ids.clone(), requests, kv_heads=True, cache=cache) is first
    assert cache.forwards == 1
    collect_model(model, ids, requests, cache=cache)  # another request: another forward
    collect_model(model, ids[:3], requests, kv_heads=True, cache=cache)  # other windows too
    assert cache.forwards == 3
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[0, 0] += 1  # in place: a new version of that tensor
    assert collect_model(model, ids, requests, kv_heads=True, cache=cache) is not first
    model.layers[0].mlp.down_proj = torch.nn.Linear(48, 32, bias=False)  # a replaced module
    again = collect_model(model, ids, requests, kv_heads=True, cache=cache)
    assert cache.forwards == 5 and collect_model(model, ids, requests, kv_heads=True, cache=cache) is again
    # the moments a centred request needs are cached as a collection of their own
    collect_model(model, ids, {NAMES[2]: InputRequest(token_amax=True, centre=True)}, cache=cache)
    collect_model(model, ids, {NAMES[2]: InputRequest(gram="all", centre=True)}, cache=cache)
    assert cache.forwards == 5 + 3


@dataclass
class _Options:
    change_model: bool = False


class StatsDouble(Pass):
    """Test double: asks for the same statistics as any other of its kind; changes the model if told."""

    name = "test_stats_double"
    Options = _Options

    def run(self, model, context):
        stats = context.input_statistics(model, context.calibration_windows(), {NAMES[2]: InputRequest(token_amax=True)})
        if self.options.change_model:
            with torch.no_grad():
                model.layers[1].mlp.up_proj.weight.mul_(0.5)  # down_proj's input changes
        return PassReport(self.name, metrics={"amax": float(stats.inputs[NAMES[2]].token_amax.max())})


@pytest.mark.parametrize("changes, forwards", [((False, False, False), 1), ((True, False, False), 2),
                                               ((False, True, False), 2), ((False, False, True), 1)])
def test_passes_asking_the_same_of_an_unchanged_model_share_one_forward(model, byte_tokenizer, changes, forwards):
    PASSES[StatsDouble.name] = StatsDouble
    try:
        config = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 16},
                                           "passes": [{"name": StatsDouble.name, "change_model": c} for c in changes]})
        context = PassContext(tokenizer=byte_tokenizer, calibration=CalibrationConfig(samples=4, seq_len=16))
        with torch.no_grad():
            model.embed_tokens = torch.nn.Embedding(len(byte_tokenizer), CONFIG.dim)
        reports = Pipeline(config).run(model, context)
    finally:
        PASSES.pop(StatsDouble.name)
    assert context.statistics.forwards == forwards
    amax = [r.metrics["amax"] for r in reports]
    assert (amax[0] == amax[1]) is (not changes[0])
    assert bool(context.statistics._entries) is (not changes[-1])  # a changed model's statistics are dropped
