"""Calibration statistics: one collector that every pass reads its activation statistics from.

A pass asks, per module, for statistics of that module's input x [..., K] over the calibration
tokens (an ``InputRequest``); the collector hooks those modules, runs the forward once and
returns one ``InputStatistics`` per module:

    mean_abs     [K]       mean |x| per channel over every token (AWQ's scales)
    mean, mean_square [K]  channel moments, float64 (FP8's input shift and outlier channels)
    hessian      [K, K]    XᵀX / T, over every token (``gram="all"``) or a seeded token subsample
                           (``gram="sampled"``, a ``TokenSampler``); GPTQ and AWQ's searches
    token_amax   [T]       per-token max |x| (FP8's static scales)
    channel_min, channel_max [K]  each channel's extremes over every token (SmoothQuant's
                           migration, INT8's static per-tensor range)
    rows         [R, K]    every (T/R)-th input row, raw, for measuring a layer's output error
    shift, outliers        the channel mean and the r channels of largest second moment, when
                           ``centre`` / ``outlier_channels`` ask for them

and, with ``kv_heads``, each attention layer's K/V abs-max per channel (``KVObserver``).

Two drivers run the forward:

- ``collect_model``: the whole model over calibration windows (FP8). ``centre`` and
  ``outlier_channels`` need the channel means before the abs-maxima and the Gram matrix of the
  centred input can be taken, so a request with either runs two forwards (moments, then the
  rest); that second forward is inherent, not a second hook system.
- ``collect_block``: one decoder block over its captured inputs, returning the block's outputs,
  the next block's inputs (AWQ, which quantizes a block before capturing the next, so its memory
  stays one block's activations; FP8 in a streamed compile, in the chunks ``collect_model``
  uses, so that both give the same statistics).

``PassContext.input_statistics`` caches ``collect_model``'s results by model state
(``ModelState``): two passes asking for statistics of an unchanged model share one forward. A pass
that quantizes changes the state, so the next pass's statistics are of the quantized model, as
they must be.

Modules that read one tensor (q/k/v, gate/up) with equal requests share one set of statistics:
the hook sees the same input object and adds it once. An MoE expert's Linears read only the
tokens routed to that expert, so their statistics are per expert (``tokens`` counts them), and
a sampled Gram draws each expert's own sample, at the rate of the chunk's.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import torch
import torch.nn as nn

from compiler.formats.kv_quant import KVObserver
from compiler.io.stream import trim_heap
from compiler.progress import track


@dataclass(frozen=True)
class InputRequest:
    """The statistics a pass needs of one module's input (see the module docstring)."""

    mean_abs: bool = False
    moments: bool = False
    # "all": XᵀX over every token, a sum of one product per batch; "sampled": over the tokens a
    # TokenSampler draws, accumulated in place (addmm_). The two accumulate differently because
    # each pass's recorded figures were made that way and depend on the last bits.
    gram: Literal["none", "all", "sampled"] = "none"
    token_amax: bool = False
    channel_range: bool = False
    rows: int = 0  # this many rows, evenly strided over the calibration tokens
    centre: bool = False  # Gram and token abs-max of x less its channel mean
    outlier_channels: int = 0  # this many channels (largest second moment, centred) left out of token_amax

    def __post_init__(self):
        if self.gram not in ("none", "all", "sampled"):
            raise ValueError(f"gram must be 'none', 'all' or 'sampled', got {self.gram!r}")
        if self.rows < 0 or self.outlier_channels < 0:
            raise ValueError("rows and outlier_channels must be >= 0")

    @property
    def needs_moments(self) -> bool:
        return self.centre or self.outlier_channels > 0

    @property
    def collects(self) -> bool:
        """Whether the forward has anything to record (else only the moments' shift and outliers)."""
        return (self.mean_abs or self.moments or self.gram != "none" or self.token_amax or self.channel_range
                or self.rows > 0)


class TokenSampler:
    """Draws, per forward chunk of n tokens, about ``keep * n / total`` of them (at least one)
    with a seeded generator: the token subsample a ``gram="sampled"`` Gram matrix is built on."""

    def __init__(self, keep: int, total: int, generator: torch.Generator):
        self.keep, self.total, self.generator = keep, total, generator

    def draw(self, n_tokens: int) -> torch.Tensor:
        k = max(1, round(self.keep * n_tokens / self.total))
        return torch.randperm(n_tokens, generator=self.generator)[: min(k, n_tokens)]


class InputStatistics:
    """Running statistics of one module's input, as its ``InputRequest`` asks (``add`` per chunk)."""

    def __init__(self, request: InputRequest, in_features: int, row_stride: int = 1,
                 shift: torch.Tensor | None = None, outliers: torch.Tensor | None = None):
        self.request, self.row_stride = request, row_stride
        self.shift, self.outliers = shift, outliers  # float32 [K], int64 [r]
        self.tokens, self._k = 0, in_features
        self._abs_sum = torch.zeros(in_features, dtype=torch.float64) if request.mean_abs else None
        self._sum = self._square_sum = None
        self._gram = torch.zeros(in_features, in_features) if request.gram == "sampled" else None
        self._gram_tokens = 0
        self._amax: list[torch.Tensor] = []
        self._channel_min = self._channel_max = None
        self._rows: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, sample: torch.Tensor | None = None) -> None:
        """x [..., K]: the module's input for one chunk; ``sample``: the flattened token indices
        a sampled Gram takes from it."""
        r = self.request
        flat = x.detach().reshape(-1, x.shape[-1])  # [T, K]
        self.tokens += flat.shape[0]
        if r.mean_abs:
            self._abs_sum += flat.float().abs().sum(0, dtype=torch.float64)
        if r.moments:
            xd = flat.double()
            s1, s2 = xd.sum(0), xd.square().sum(0)
            self._sum = s1 if self._sum is None else self._sum + s1
            self._square_sum = s2 if self._square_sum is None else self._square_sum + s2
        if r.channel_range and flat.shape[0]:
            low, high = flat.float().aminmax(dim=0)
            self._channel_min = low if self._channel_min is None else torch.minimum(self._channel_min, low)
            self._channel_max = high if self._channel_max is None else torch.maximum(self._channel_max, high)
        if r.rows:
            self._rows.append(flat[:: self.row_stride].float().clone())
        if r.gram == "sampled":
            picked = flat.float()[sample]
            self._gram.addmm_(picked.T, picked)
            self._gram_tokens += picked.shape[0]
        if r.token_amax or r.gram == "all":
            xf = flat.float() - self.shift if self.shift is not None else flat.float()
            if r.token_amax:
                magnitude = xf.abs()  # a new tensor: the outlier channels can be zeroed in place
                if self.outliers is not None:
                    magnitude.index_fill_(1, self.outliers, 0)
                self._amax.append(magnitude.amax(-1))
            if r.gram == "all":
                product = xf.T @ xf
                self._gram = product if self._gram is None else self._gram + product
                self._gram_tokens += xf.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        """[K] float32."""
        return (self._abs_sum / max(self.tokens, 1)).float()

    @property
    def mean(self) -> torch.Tensor:
        """[K] float64 (zeros when the module saw no token: an expert never routed to)."""
        return self._sum / self.tokens if self.tokens else torch.zeros(self._k, dtype=torch.float64)

    @property
    def mean_square(self) -> torch.Tensor:
        """[K] float64."""
        return self._square_sum / self.tokens if self.tokens else torch.zeros(self._k, dtype=torch.float64)

    @property
    def hessian(self) -> torch.Tensor:
        """H = XᵀX / T [K, K]: a weight error D [N, K] costs sum((D @ H) * D) of mean squared
        output error per token."""
        return self._gram / max(self._gram_tokens, 1) if self._gram is not None else torch.zeros(self._k, self._k)

    @property
    def token_amax(self) -> torch.Tensor:
        """[T] float32."""
        return torch.cat(self._amax)

    @property
    def channel_min(self) -> torch.Tensor:
        """[K] float32 (zeros when the module saw no token)."""
        return self._channel_min if self._channel_min is not None else torch.zeros(self._k)

    @property
    def channel_max(self) -> torch.Tensor:
        """[K] float32 (zeros when the module saw no token)."""
        return self._channel_max if self._channel_max is not None else torch.zeros(self._k)

    @property
    def rows(self) -> torch.Tensor:
        """[R, K] float32."""
        return torch.cat(self._rows)[: self.request.rows]


@dataclass
class CalibrationStatistics:
    """What one collection returns: statistics per requested module, K/V abs-max per layer."""

    inputs: dict[str, InputStatistics]
    kv: list[KVObserver]


def _shift_and_outliers(request: InputRequest, moments: InputStatistics | None):
    """(shift [K] float32 or None, outlier channel indices [r] sorted or None) from the moments."""
    if moments is None or moments.tokens == 0:  # an expert no calibration token reached: nothing to centre on
        return None, None
    shift = moments.mean.float() if request.centre else None
    outliers = None
    if request.outlier_channels:
        square = moments.mean_square - moments.mean.square() if request.centre else moments.mean_square
        outliers = square.topk(request.outlier_channels).indices.sort().values
    return shift, outliers


class _Hooks:
    """Forward pre-hooks feeding each requested module's input into its statistics; modules that
    read one tensor with equal requests (and equal moments) share the first reader's statistics."""

    def __init__(self, root: nn.Module, requests: dict[str, InputRequest], total_tokens: int,
                 moments: dict[str, InputStatistics] | None = None):
        self.stats: dict[str, InputStatistics] = {}
        # Set per chunk by the driver: the chunk's token indices a sampled Gram takes, drawn by
        # ``sampler`` over ``chunk_tokens``; an input of fewer rows (an expert's: only the tokens
        # routed to it) draws its own, at the same rate.
        self.sample: torch.Tensor | None = None
        self.sampler: TokenSampler | None = None
        self.chunk_tokens = 0
        self._last: tuple | None = None  # (input tensor, name): held, so its id is never reused
        self._handles = []
        for name, request in requests.items():
            module = root.get_submodule(name)
            stride = max(1, total_tokens // request.rows) if request.rows else 1
            shift, outliers = _shift_and_outliers(request, (moments or {}).get(name))
            self.stats[name] = InputStatistics(request, module.in_features, stride, shift, outliers)
            self._handles.append(module.register_forward_pre_hook(self._hook(name, requests, moments or {})))

    def _hook(self, name, requests, moments):
        def record(_module, args):
            x = args[0]
            if self._last is not None and x is self._last[0]:
                first = self._last[1]
                if requests[first] == requests[name] and moments.get(first) is moments.get(name):
                    self.stats[name] = self.stats[first]
                    return
            self._last = (x, name)
            sample = self.sample
            if sample is not None and x[..., 0].numel() != self.chunk_tokens:
                sample = self.sampler.draw(x[..., 0].numel())
            self.stats[name].add(x, sample)
        return record

    def trim_after(self, blocks) -> None:
        """Hand each block's freed activations back to the kernel once it has run, so that the
        peak of a whole-model forward is the live statistics, not every block's leftovers."""
        self._handles += [block.register_forward_hook(lambda *_: trim_heap()) for block in blocks]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._last = None


def _needs_sample(requests: dict[str, InputRequest], sampler: TokenSampler | None) -> bool:
    wanted = any(r.gram == "sampled" for r in requests.values())
    if wanted and sampler is None:
        raise ValueError('gram="sampled" needs a TokenSampler')
    return wanted


def collect_model(model: nn.Module, windows: torch.Tensor, requests: dict[str, InputRequest],
                  kv_heads: bool = False, batch_size: int = 4, label: str = "calibrating",
                  sampler: TokenSampler | None = None, cache: "StatisticsCache | None" = None) -> CalibrationStatistics:
    """Run ``model`` over ``windows`` [S, T] in batches of ``batch_size`` and collect ``requests``
    (module name -> InputRequest); with ``kv_heads``, each attention layer's K/V abs-max per channel.
    A ``cache`` (``PassContext``'s) returns what the model in the same state already gave (not
    with a ``sampler``, whose generator moves on)."""
    run = lambda: _collect_model(model, windows, requests, kv_heads, batch_size, label, sampler, cache)  # noqa: E731
    if cache is None or sampler is not None:
        return run()
    return cache.get_or_collect(model, windows, (tuple(sorted(requests.items())), kv_heads, batch_size), run)


@torch.inference_mode()
def _collect_model(model, windows, requests, kv_heads, batch_size, label, sampler, cache) -> CalibrationStatistics:
    moments = None
    first = {n: InputRequest(moments=True) for n, r in requests.items() if r.needs_moments}
    if first:
        moments = collect_model(model, windows, first, batch_size=batch_size, label=f"{label} (input moments)",
                                cache=cache).inputs
    draws = _needs_sample(requests, sampler)
    hooks = _Hooks(model, requests, windows.numel(), moments)
    if not kv_heads and not any(r.collects for r in requests.values()):
        hooks.remove()
        return CalibrationStatistics(hooks.stats, [])
    observers = [KVObserver() for _ in model.layers] if kv_heads else []
    saved = [layer.self_attn.kv_quant for layer in model.layers]
    for layer, obs in zip(model.layers, observers):
        layer.self_attn.kv_quant = obs
    device = next(model.parameters()).device
    batches = windows.split(batch_size)
    hooks.sampler = sampler
    hooks.trim_after(model.layers)
    try:
        for batch in track(batches, label, total=len(batches)):
            hooks.sample, hooks.chunk_tokens = (sampler.draw(batch.numel()) if draws else None), batch.numel()
            model(batch.to(device))
    finally:
        hooks.remove()
        for layer, prev in zip(model.layers, saved):
            layer.self_attn.kv_quant = prev
    return CalibrationStatistics(hooks.stats, observers)


def collect_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  requests: dict[str, InputRequest], sampler: TokenSampler | None = None,
                  moments: dict[str, InputStatistics] | None = None) -> tuple[torch.Tensor, CalibrationStatistics]:
    """Run decoder ``block`` over its inputs x [S, T, dim] in chunks of ``positions.shape[0]``
    sequences (``cos``/``sin``/``positions`` are those of one chunk) and collect ``requests``
    (names relative to the block; ``moments``: the channel moments a centring request needs, from
    an earlier collection). Returns the block's outputs [S, T, dim] and the statistics."""
    draws = _needs_sample(requests, sampler)
    hooks = _Hooks(block, requests, x.shape[0] * x.shape[1], moments)
    hooks.sampler = sampler
    out = torch.empty_like(x)
    b = positions.shape[0]
    try:
        for start in range(0, x.shape[0], b):
            chunk = x[start : start + b]
            n = chunk.shape[0]
            hooks.sample, hooks.chunk_tokens = (sampler.draw(n * chunk.shape[1]) if draws else None), n * chunk.shape[1]
            out[start : start + n] = block(chunk, cos[:n], sin[:n], positions[:n])
    finally:
        hooks.remove()
    return out, CalibrationStatistics(hooks.stats, [])


class ModelState:
    """A fingerprint of a model's state: which modules it holds, and each parameter and buffer's
    identity, storage and in-place version counter (torch bumps ``_version`` on every in-place
    op). Two equal fingerprints mean no pass replaced or modified a weight in between. Held by
    weak references, so a fingerprint keeps no replaced weight alive."""

    def __init__(self, model: nn.Module):
        self._modules = [(name, weakref.ref(m)) for name, m in model.named_modules()]
        self._tensors = []
        for t in chain(model.parameters(), model.buffers()):
            try:
                version = t._version
            except RuntimeError:  # an inference-mode tensor counts no versions: never call it unchanged
                version = None
            self._tensors.append((weakref.ref(t), t.data_ptr(), version))

    def same_as(self, other: "ModelState") -> bool:
        if len(self._modules) != len(other._modules) or len(self._tensors) != len(other._tensors):
            return False
        for (n1, m1), (n2, m2) in zip(self._modules, other._modules):
            if n1 != n2 or m1() is None or m1() is not m2():
                return False
        for (t1, p1, v1), (t2, p2, v2) in zip(self._tensors, other._tensors):
            if t1() is None or t1() is not t2() or p1 != p2 or v1 is None or v1 != v2:
                return False
        return True


class StatisticsCache:
    """``collect_model`` results by (model state, windows, request key). Only the current state's
    entries are kept: ``prune`` (the pipeline calls it after every pass) drops the rest."""

    def __init__(self):
        self._entries: list[tuple[ModelState, torch.Tensor, tuple, CalibrationStatistics]] = []
        self.forwards = 0  # collections actually run

    def get_or_collect(self, model: nn.Module, windows: torch.Tensor, key: tuple, collect) -> CalibrationStatistics:
        state = ModelState(model)
        for s, w, k, stats in self._entries:
            if k == key and w.shape == windows.shape and torch.equal(w, windows) and s.same_as(state):
                return stats
        stats = collect()
        self.forwards += 1
        self.prune(model)
        self._entries.append((state, windows.clone(), key, stats))
        return stats

    def prune(self, model: nn.Module) -> None:
        """Forget the statistics of any state ``model`` is no longer in (frees their memory)."""
        state = ModelState(model)
        self._entries = [e for e in self._entries if e[0].same_as(state)]
