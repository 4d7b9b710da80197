"""AWQ quality guards that fail when the quality regresses, measured only through the pass's options.

The model: a tiny random Llama whose activations have what AWQ exists for — six salient hidden
channels (its RMSNorm weights ×8 there) that tokens of the calibration domain excite further (the
merged BPE tokens' embeddings +3 there); for the duo-scaling guard, a variant whose linears also
have outlier weight columns (1 in 16 input columns ×8), what duo scaling's weight term is for.
AWQ calibrates on 8 windows of pydoc's calibration pool; every error is measured on 16 held-out
windows of pydoc's evaluation region, never on calibration windows: the mean over tokens of
|logits - float logits| / |float logits|. RTN is ``Int4Linear.from_float`` at the same group size.

Each guard compares two option settings, everything else at its default, by a stated margin;
measured on model seeds 0 (the one tested) and 1 (8 calibration samples), in brackets:

- AWQ (defaults: GPTQ rounding) <= 0.5 × RTN                              [0.28, 0.35]
- AWQ with round-to-nearest codes ("plain" AWQ) <= 0.8 × RTN              [0.63, 0.65]
- the activation-aware scales alone (s = mean|x|^α searched; round-to-nearest, no clip, no duo
  scaling) <= 0.85 × RTN                                                  [0.70, 0.76]
- clip search on <= 0.96 × off (round-to-nearest, where clipping sets the grid) [0.91, 0.91]
- calibrated on pydoc <= 0.65 × calibrated on unrelated (CJK) text: real activation
  statistics against ones that never see the domain's salient channels   [0.41, 0.49]
- duo scaling alone (α = 0: s = 1 / mean|ŵ|, round-to-nearest, no clip) <= 0.9 × without it,
  on the outlier-weight variant                                           [0.68, 0.82]
  (without duo, α = 0 is RTN itself: checked to be equal).

Over the full α search duo scaling shows no consistent held-out gain on these models (0.88-1.11
across seeds and sample counts), so it is guarded where its weight term acts by construction.

Broken on purpose once each (in a scratch copy of passes/awq_search.py's InputStats, search_clip,
candidate_scales), every break fails a guard: uniform statistics (mean |x| of ones and an identity
Gram) fail four (AWQ vs RTN 0.95); an identity Gram alone three; mean |x| of ones alone the
plain-AWQ guard (0.81) and the scales guard (s = 1 for every α: RTN itself); a clip search that
never clips the clip guard (1.00); duo scaling that ignores the weights the duo guard (1.00).
"""
from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model

import passes  # noqa: F401  (registers awq)
from calib import load_corpus_text
from calib.protocol import evaluation_windows, split_tokens
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import linear_modules
from compiler.io.load import load_checkpoint
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_loaded

GROUP = 32
SALIENT = 6
SAMPLES = 8  # calibration windows of 64 tokens


def tiny_model_with_salient_channels(path, tokenizer, seed: int = 0, weight_outliers: float = 1.0):
    hf = make_hf_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2)
    salient = torch.randperm(128, generator=torch.Generator().manual_seed(100 + seed))[:SALIENT]
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.input_layernorm.weight[salient] *= 8
            layer.post_attention_layernorm.weight[salient] *= 8
        merged = torch.arange(259, len(tokenizer))  # BPE merges: frequent in pydoc, absent from unrelated text
        hf.model.embed_tokens.weight[merged[:, None], salient[None]] += 3.0
        if weight_outliers != 1.0:
            g = torch.Generator().manual_seed(7 + seed)
            for linear in hf.model.layers.modules():
                if isinstance(linear, torch.nn.Linear):
                    linear.weight[:, torch.randperm(linear.in_features, generator=g)[: linear.in_features // 16]] *= weight_outliers
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Quality:
    """Compiles option settings once each and measures them on the held-out windows."""

    def __init__(self, tmp, tokenizer, seed: int = 0, samples: int = SAMPLES, weight_outliers: float = 1.0):
        self.tmp, self.samples = tmp, samples
        self.src = tiny_model_with_salient_channels(tmp / "hf", tokenizer, seed, weight_outliers)
        ids = torch.tensor(tokenizer(load_corpus_text("pydoc")[:400_000])["input_ids"])
        self.held_out = evaluation_windows(split_tokens(ids).evaluation, 16, 64)  # never in the calibration pool
        self.unrelated = tmp / "unrelated.txt"  # CJK text: none of pydoc's merged tokens
        rng = random.Random(0)
        self.unrelated.write_text("".join(chr(rng.randrange(0x4E00, 0x9FFF)) if i % 7 else " " for i in range(60_000)))
        with torch.no_grad():
            self.reference = load_checkpoint(self.src).model(self.held_out)
        self._errors: dict[str, float] = {}

    @torch.no_grad()
    def error(self, model) -> float:
        out = model(self.held_out)
        e = float(((out - self.reference).norm(dim=-1) / self.reference.norm(dim=-1)).mean())
        assert e == e, "NaN output error"
        return e

    def rtn(self) -> float:
        if "rtn" not in self._errors:
            loaded = load_checkpoint(self.src)
            for name, linear in linear_modules(loaded.model).items():
                if name != "lm_head":
                    loaded.model.set_submodule(name, Int4Linear.from_float(linear, GROUP))
            self._errors["rtn"] = self.error(loaded.model)
        return self._errors["rtn"]

    def awq(self, corpus: str = "pydoc", **options) -> float:
        key = f"{corpus}:{sorted(options.items())}"
        if key not in self._errors:
            loaded = load_checkpoint(self.src)
            config = PipelineConfig.from_dict({"calibration": {"corpus": corpus, "samples": self.samples, "seq_len": 64, "seed": 0},
                                               "passes": [{"name": "awq", "group_size": GROUP, **options}]})
            compile_loaded(loaded, config, self.tmp / f"awq-{len(self._errors)}")
            self._errors[key] = self.error(loaded.model)
        return self._errors[key]


@pytest.fixture(scope="module")
def quality(tmp_path_factory, byte_tokenizer):
    return Quality(tmp_path_factory.mktemp("awq-quality"), byte_tokenizer)


@pytest.fixture(scope="module")
def quality_weight_outliers(tmp_path_factory, byte_tokenizer):
    return Quality(tmp_path_factory.mktemp("awq-quality-w"), byte_tokenizer, weight_outliers=8.0)


def compare(label: str, better: float, worse: float, margin: float) -> None:
    print(f"{label}: {better:.4f} vs {worse:.4f} (ratio {better / worse:.2f}, bound {margin})")
    assert better <= margin * worse, f"{label}: {better:.4f} is not below {margin} × {worse:.4f}"


def test_awq_beats_rtn_on_held_out_text(quality):
    compare("AWQ vs RTN", quality.awq(), quality.rtn(), 0.5)


def test_plain_awq_beats_rtn_on_held_out_text(quality):
    """Without GPTQ's rounding, so the scale search and clipping alone must earn the margin."""
    compare("AWQ round-to-nearest vs RTN", quality.awq(weight_rounding="nearest"), quality.rtn(), 0.8)


def test_activation_aware_scales_beat_rtn_on_held_out_text(quality):
    """The scale search alone: with round-to-nearest codes, no clipping and no duo scaling, only
    s = mean|x|^α (α searched) separates the pass from RTN."""
    scales_only = quality.awq(weight_rounding="nearest", clip_search=False, duo_scaling="none")
    compare("activation-aware scales alone vs RTN", scales_only, quality.rtn(), 0.85)


def test_clip_search_lowers_held_out_error(quality):
    compare("clip search on vs off", quality.awq(weight_rounding="nearest"),
            quality.awq(weight_rounding="nearest", clip_search=False), 0.96)


def test_duo_scaling_flattens_outlier_weight_columns(quality_weight_outliers):
    """At α = 0 the scales are duo scaling's weight term alone, s = 1 / mean|ŵ|; without duo, s = 1."""
    q = quality_weight_outliers
    alone = dict(alpha_grid=1, weight_rounding="nearest", clip_search=False)
    without = q.awq(duo_scaling="none", **alone)
    assert without == pytest.approx(q.rtn(), rel=1e-6)  # s = 1: the pass is RTN
    compare("duo scaling at α = 0 vs without", q.awq(duo_scaling="all", **alone), without, 0.9)


def test_activation_statistics_of_the_domain_matter(quality):
    """Calibrated on text that never excites the salient channels, AWQ protects the wrong ones."""
    compare("calibrated on pydoc vs unrelated text", quality.awq(), quality.awq(corpus=str(quality.unrelated)), 0.65)
