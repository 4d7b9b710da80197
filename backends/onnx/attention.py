"""The decoder graph's attention, two ways (``GraphSpec.fused_attention`` picks one):

    standard  opset-17 ops only (what ATC reads). q/k/v as [B, H, T, D]; one ``past_len`` [1] for
              the whole batch; the new K/V written into the [B, Hkv, L, D] cache at past_len..
              (ScatterElements, or a Where on a one-slot mask when T is statically 1, which keeps
              every shape static for ATC); attention over all L slots under a boolean mask (key j
              visible when 0 <= pos - j, and < the window in a sliding layer).
    fused     com.microsoft GroupQueryAttention, for ONNX Runtime. q/k/v stay [B, T, H * D]; each
              batch row has its own length (``past_lens`` [B] at decode), which the op takes as
              ``seqlens_k`` (row length after this call, minus one) and ``total_sequence_length``
              (the batch's longest); it writes the new K/V into the cache it is given (bound as
              both past and present: one buffer) and reads only that row's own positions, so rows
              of different lengths decode in one call and no step attends over unused slots.
              The prefill graph takes the cache buffers too (its rows' positions 0..T-1 are written).

Both follow ``compiler.model.layers.Attention``: q/k RMSNorm per head before RoPE (Qwen3, Gemma 3),
the layer's RoPE table (``rope_index``) and window, Gemma 3's query_pre_attn_scalar, and the FP8
KV cache's rounding of the new K (after RoPE) and V (``kv_rounding.py``). GroupQueryAttention's
sliding window (``local_window_size`` W) lets a query see W keys, itself included, as the model's
mask does; its ``scale`` carries query_pre_attn_scalar. Rotary: in the op (``do_rotary``) where the
tables are rotate-half and no FP8 rounding has to come between RoPE and the cache; else as
com.microsoft RotaryEmbedding or standard ops before it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
import torch.nn as nn
from onnx import TensorProto

from backends.onnx.kv_rounding import kv_rounding
from backends.onnx.ops import MS_DOMAIN, GraphBuilder, fused_rope, linear, packed_linear, rms_norm, rope
from compiler.model.transformer import Transformer

RopeTable = tuple[str, str, bool]  # (cos, sin, fused: half tables [L, D / 2] for the contrib ops)


class AttentionEmitter(ABC):
    """What both kinds share: the graph-wide positions and RoPE tables, built once and read by every layer."""

    def __init__(self, model: Transformer, spec, b: GraphBuilder):
        self.model, self.spec, self.c, self.b = model, spec, model.config, b
        self.decode = spec.kind == "decode"
        self._positions: str | None = None
        self._tables: list[RopeTable] | None = None

    def positions(self) -> str:
        """This call's absolute positions (the subclass's layout), built on first use."""
        if self._positions is None:
            self._positions = self._build_positions()
        return self._positions

    def rope_table(self, index: int) -> RopeTable:
        """The table of RoPE base ``index`` (``Attention.rope_index``: Gemma 3's sliding layers read 1)."""
        if self._tables is None:
            self._tables = self._rope_tables()
        return self._tables[index]

    def _rope_tables(self) -> list[RopeTable]:
        """(cos, sin, fused) for each RoPE base the model has. The tables are the torch model's own
        rope() over every cache position, so values match bit for bit. ``fused``: the contrib ops'
        half tables [L, D / 2], read at this call's positions by the op; else this call's rows of the
        full tables (``_gathered``). A table whose two halves differ (not rotate-half RoPE) is never fused."""
        cos, sin = self.model.rope(torch.arange(self.spec.max_len)[None], torch.float32)  # [1, R, L, D]
        b, tables, half = self.b, [], cos.shape[-1] // 2
        for r in range(cos.shape[1]):
            suffix = "" if r == 0 else f".{r}"
            c, s = cos[0, r], sin[0, r]
            if self.spec.fused_rotary and c.shape[-1] == self.c.head_dim and all(
                    torch.equal(t[:, :half], t[:, half:]) for t in (c, s)):
                tables.append((b.fweight(f"rope.cos_half{suffix}", c[:, :half]),
                               b.fweight(f"rope.sin_half{suffix}", s[:, :half]), True))
                continue
            cos_t, sin_t = b.fweight(f"rope.cos{suffix}", c), b.fweight(f"rope.sin{suffix}", s)
            tables.append((self._gathered(cos_t), self._gathered(sin_t), False))
        return tables

    @abstractmethod
    def _build_positions(self) -> str:
        """This call's absolute positions, in the layout the subclass's tables are gathered with."""

    @abstractmethod
    def _gathered(self, table: str) -> str:
        """This call's rows of a full [L, D] RoPE table, shaped to broadcast against the subclass's q/k."""

    @abstractmethod
    def __call__(self, x: str, attn: nn.Module, i: int) -> tuple[str, list[str]]:
        """x [B, T, dim] (normalised) -> the attention block's output [B, T, dim] and the layer's present names."""

    def _seq_len(self, scope: str) -> str:
        """T, int64 scalar."""
        b = self.b
        return b.op("Gather", [b.op("Shape", ["input_ids"], scope), b.const(1, scope)], scope, axis=0)


class StandardAttention(AttentionEmitter):
    """Attention in standard opset-17 ops over the whole [B, Hkv, L, D] cache (see the module docstring)."""

    def __init__(self, model: Transformer, spec, b: GraphBuilder):
        super().__init__(model, spec, b)
        self._key_pos: str | None = None  # decode: Range(0, L), every cache slot
        self._slot: str | None = None
        self._scatter_index: str | None = None  # decode: ScatterElements' indices into the cache
        self._diff: str | None = None  # [T, Lk] query position minus key position
        self._masks: dict[int | None, str] = {}  # by attention window (None: full causal)

    def _build_positions(self) -> str:
        """[T]: past_len + arange(T)."""
        b = self.b
        pos = b.op("Range", [b.const(0, "/positions"), self._seq_len("/positions"), b.const(1, "/positions")], "/positions")
        return b.op("Add", [pos, "past_len"], "/positions") if self.decode else pos

    def _gathered(self, table: str) -> str:
        """[T, D]: broadcasts against q/k [B, H, T, D]."""
        return self.b.op("Gather", [table, self.positions()], "/rope", axis=0)

    def _heads(self, x: str, n_heads: int, scope: str) -> str:
        """[B, T, H*D] -> [B, H, T, D]."""
        b = self.b
        x = b.op("Reshape", [x, b.const([0, 0, n_heads, self.c.head_dim], scope)], scope)
        return b.op("Transpose", [x], scope, perm=[0, 2, 1, 3])

    def __call__(self, x: str, attn: nn.Module, i: int) -> tuple[str, list[str]]:
        b, c, p, dq = self.b, self.c, f"layers.{i}.self_attn", self.spec.dequantize
        hd, n_rep = c.head_dim, c.n_heads // c.n_kv_heads
        q = self._heads(linear(b, x, attn.q_proj, f"{p}.q_proj", dq), c.n_heads, p)
        k = self._heads(linear(b, x, attn.k_proj, f"{p}.k_proj", dq), c.n_kv_heads, p)
        v = self._heads(linear(b, x, attn.v_proj, f"{p}.v_proj", dq), c.n_kv_heads, p)
        if c.spec.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's D channels, before RoPE
            q, k = rms_norm(b, q, attn.q_norm, f"{p}.q_norm"), rms_norm(b, k, attn.k_norm, f"{p}.k_norm")
        cos, sin, fused = self.rope_table(attn.rope_index)
        if fused:
            offset = "past_len" if self.decode else b.const([0], p)
            q, k = fused_rope(b, q, cos, sin, offset, p), fused_rope(b, k, cos, sin, offset, p)
        else:
            q, k = rope(b, q, cos, sin, hd // 2, p), rope(b, k, cos, sin, hd // 2, p)
        if attn.q_scale != 1.0:  # Gemma 3's query_pre_attn_scalar, as Attention applies it (q times the ratio)
            q = b.op("Mul", [q, b.fconst(attn.q_scale, p)], p)
        k, v = kv_rounding(b, attn, k, v, p)
        k_all, v_all = self._cache_write(k, f"key.{i}", p), self._cache_write(v, f"value.{i}", p)
        keys, values = (k_all, v_all) if self.decode else (k, v)
        # Grouped-query attention by broadcasting: q [B, Hkv, rep, T, D] against k [B, Hkv, 1, Lk, D].
        qg = b.op("Reshape", [q, b.const([0, c.n_kv_heads, n_rep, -1, hd], p)], p)
        kt = b.op("Transpose", [b.op("Unsqueeze", [keys, b.const([2], p)], p)], p, perm=[0, 1, 2, 4, 3])
        scores = b.op("Mul", [b.op("MatMul", [qg, kt], p), b.fconst(1.0 / np.sqrt(hd), p)], p)
        scores = b.op("Where", [self._mask(attn.sliding_window), scores, b.fconst(np.finfo(b.np_dtype).min, p)], p)
        probs = b.op("Softmax", [scores], p, axis=-1)
        out = b.op("MatMul", [probs, b.op("Unsqueeze", [values, b.const([2], p)], p)], p)  # [B, Hkv, rep, T, D]
        out = b.op("Reshape", [out, b.const([0, c.n_heads, -1, hd], p)], p)
        out = b.op("Transpose", [out], p, perm=[0, 2, 1, 3])
        out = b.op("Reshape", [out, b.const([0, 0, c.n_heads * hd], p)], p)
        return linear(b, out, attn.o_proj, f"{p}.o_proj", dq), [f"present_key.{i}", f"present_value.{i}"]

    def _mask(self, window: int | None) -> str:
        """Boolean [T, Lk]: key j is visible to query t when 0 <= pos[t] - j (< window); one per window."""
        if window in self._masks:
            return self._masks[window]
        b, positions = self.b, self.positions()
        if None not in self._masks:  # the causal mask: every other window narrows it
            key_pos = positions
            if self.decode:  # every cache slot; built in-graph so no large constant sits outside the shared weights
                key_pos = b.op("Range", [b.const(0, "/mask"), b.const(self.spec.max_len, "/mask"), b.const(1, "/mask")], "/mask")
                self._key_pos = key_pos
            self._diff = b.op("Sub", [b.op("Unsqueeze", [positions, b.const([1], "/mask")], "/mask"),
                                      b.op("Unsqueeze", [key_pos, b.const([0], "/mask")], "/mask")], "/mask")
            self._masks[None] = b.op("GreaterOrEqual", [self._diff, b.const(0, "/mask")], "/mask")
        if window is not None:
            inside = b.op("Less", [self._diff, b.const(window, "/mask")], "/mask")
            self._masks[window] = b.op("And", [self._masks[None], inside], "/mask")
        return self._masks[window]

    def _cache_write(self, new: str, which: str, scope: str) -> str:
        """The cache after this call, [B, Hkv, L, D], emitted as graph output ``present_{which}``."""
        b, L = self.b, self.spec.max_len
        if self.decode and self.spec.seq == 1:
            # One token at static shapes: select slot past_len by mask. Slice/Concat at past_len
            # would give data-dependent shapes, which ATC's static .om graphs cannot hold.
            b.op("Where", [self._slot_mask(), new, f"past_{which}"], scope)
        elif self.decode:  # one copy of the cache with the new rows in place (Slice + Concat made two)
            b.op("ScatterElements", [f"past_{which}", self._new_slots(new), new], scope, axis=2)
        else:
            seq = b.op("Gather", [b.op("Shape", [new], scope), b.const([2], scope)], scope, axis=0)
            pad_end = b.op("Sub", [b.const([L], scope), seq], scope)
            pads = b.op("Concat", [b.const([0, 0, 0, 0, 0, 0], scope), pad_end, b.const([0], scope)], scope, axis=0)
            b.op("Pad", [new, pads], scope)
        # The last op writes the graph output itself: an Identity to it would copy the whole cache
        # again (2.4 of 27 ms of kernel time per decode step, SmolLM2 INT4, in ONNX Runtime's profile).
        b.nodes[-1].output[0] = f"present_{which}"
        return f"present_{which}"

    def _new_slots(self, new: str) -> str:
        """int64 [B, Hkv, T, D]: the cache slot (past_len + t) of every element of this call's new K or
        V rows, ScatterElements' indices (built once, shared by every layer: their shapes agree)."""
        if self._scatter_index is None:
            b = self.b
            slots = b.op("Reshape", [self.positions(), b.const([1, 1, -1, 1], "/slots")], "/slots")
            self._scatter_index = b.op("Expand", [slots, b.op("Shape", [new], "/slots")], "/slots")
        return self._scatter_index

    def _slot_mask(self) -> str:
        """Boolean [1, 1, L, 1], true at cache slot past_len (built once, shared by every layer)."""
        if self._slot is None:
            b = self.b
            self._mask(None)  # builds _key_pos
            slot = b.op("Equal", [self._key_pos, "past_len"], "/slot")
            self._slot = b.op("Reshape", [slot, b.const([1, 1, self.spec.max_len, 1], "/slot")], "/slot")
        return self._slot


class FusedAttention(AttentionEmitter):
    """Attention as com.microsoft GroupQueryAttention with per-row lengths (see the module docstring)."""

    def __init__(self, model: Transformer, spec, b: GraphBuilder):
        super().__init__(model, spec, b)
        self._lengths: list[str] | None = None

    def _build_positions(self) -> str:
        """[B, T] at decode (past_lens[b] + t), [1, T] at prefill (t)."""
        b = self.b
        pos = b.op("Range", [b.const(0, "/positions"), self._seq_len("/positions"), b.const(1, "/positions")], "/positions")
        pos = b.op("Unsqueeze", [pos, b.const([0], "/positions")], "/positions")
        if not self.decode:
            return pos
        return b.op("Add", [b.op("Unsqueeze", ["past_lens", b.const([1], "/positions")], "/positions"), pos], "/positions")

    def _gathered(self, table: str) -> str:
        """[B or 1, T, 1, D]: broadcasts against q/k split into heads, [B, T, H, D]."""
        b = self.b
        rows = b.op("Gather", [table, self.positions()], "/rope", axis=0)
        return b.op("Unsqueeze", [rows, b.const([2], "/rope")], "/rope")

    def lengths(self) -> list[str]:
        """GroupQueryAttention's length inputs, built once for every layer: seqlens_k (int32 [B], each
        row's length after this call, minus one), total_sequence_length (int32 scalar, the longest
        row's) and, at decode, query_seqlens (int32 [B], T for every row): without it the op refuses
        a call of several tokens per row on a batch of more than one row with a past (measured: no
        slower at one token per row)."""
        if self._lengths is None:
            b, s = self.b, "/lengths"
            seq = self._seq_len(s)
            if self.decode:
                ends = b.op("Add", ["past_lens", seq], s)
                total = b.op("Add", [b.op("ReduceMax", ["past_lens"], s, keepdims=0), seq], s)
                query = [b.op("Expand", [seq, b.op("Shape", ["past_lens"], s)], s)]
            else:  # every row holds the T prompt tokens
                batch = b.op("Slice", [b.op("Shape", ["input_ids"], s), b.const([0], s), b.const([1], s)], s)
                ends, total, query = b.op("Expand", [seq, batch], s), seq, []
            last = b.op("Sub", [ends, b.const(1, s)], s)
            self._lengths = [b.op("Cast", [t], s, to=TensorProto.INT32) for t in [last, total, *query]]
        return self._lengths

    def _split(self, x: str, n_heads: int, scope: str) -> str:
        """[B, T, H*D] -> [B, T, H, D] (a view: no transpose, GroupQueryAttention reads [B, T, H*D])."""
        return self.b.op("Reshape", [x, self.b.const([0, 0, n_heads, self.c.head_dim], scope)], scope)

    def _merge(self, x: str, scope: str) -> str:
        return self.b.op("Reshape", [x, self.b.const([0, 0, -1], scope)], scope)

    def _rotary_offset(self, scope: str) -> str:
        """RotaryEmbedding's positions: [B, T] at decode, the offset [0] at prefill."""
        return self.positions() if self.decode else self.b.const([0], scope)

    def __call__(self, x: str, attn: nn.Module, i: int) -> tuple[str, list[str]]:
        b, c, p, dq = self.b, self.c, f"layers.{i}.self_attn", self.spec.dequantize
        cos, sin, fused = self.rope_table(attn.rope_index)
        # The op's own rotary would come after the FP8 rounding of K, which rounds the roped K.
        in_op = fused and self.spec.rotary_in_attention and attn.kv_quant is None
        # Nothing between the projections and the op (no q/k norm, no rotary, no rounding): one packed
        # projection, which the op reads as q, k and v side by side ([B, T, (H + 2 Hkv) D]).
        packed = None
        if in_op and not c.spec.qk_norm:
            packed = packed_linear(b, x, [attn.q_proj, attn.k_proj, attn.v_proj], f"{p}.qkv_proj", dq)
        q, k, v = (packed, "", "") if packed is not None else self._qkv(x, attn, p, (cos, sin, fused), in_op)
        seqlens_k, total, *query_seqlens = self.lengths()
        inputs = [q, k, v, f"past_key.{i}", f"past_value.{i}", seqlens_k, total, *([cos, sin] if in_op else ["", ""])]
        if query_seqlens:  # input 16, after the optional inputs this graph leaves out
            inputs += [""] * 7 + query_seqlens
        while not inputs[-1]:
            inputs.pop()
        attrs = dict(num_heads=c.n_heads, kv_num_heads=c.n_kv_heads, do_rotary=int(in_op), rotary_interleaved=0)
        if attn.sliding_window is not None:
            attrs["local_window_size"] = attn.sliding_window
        if attn.q_scale != 1.0:  # Gemma 3's query_pre_attn_scalar: scores scaled by q_scale / sqrt(D)
            attrs["scale"] = float(attn.q_scale / np.sqrt(c.head_dim))
        out, _, _ = b.op("GroupQueryAttention", inputs, p, n_out=3, domain=MS_DOMAIN, **attrs)
        # present_* are the op's own outputs: bound to the past buffers, the op writes the new rows in place.
        b.nodes[-1].output[1], b.nodes[-1].output[2] = f"present_key.{i}", f"present_value.{i}"
        return linear(b, out, attn.o_proj, f"{p}.o_proj", dq), [f"present_key.{i}", f"present_value.{i}"]

    def _qkv(self, x: str, attn: nn.Module, p: str, table: RopeTable, in_op: bool) -> tuple[str, str, str]:
        """q, k, v [B, T, H * D] projected apart: q/k norms per head, the rotary embedding when the op
        does not apply it, the FP8 rounding of K and V."""
        b, c, dq = self.b, self.c, self.spec.dequantize
        q = linear(b, x, attn.q_proj, f"{p}.q_proj", dq)
        k = linear(b, x, attn.k_proj, f"{p}.k_proj", dq)
        v = linear(b, x, attn.v_proj, f"{p}.v_proj", dq)
        if c.spec.qk_norm:  # per head, before RoPE; GroupQueryAttention's own q/k norm inputs are not honoured on the CPU
            q = self._merge(rms_norm(b, self._split(q, c.n_heads, p), attn.q_norm, f"{p}.q_norm"), p)
            k = self._merge(rms_norm(b, self._split(k, c.n_kv_heads, p), attn.k_norm, f"{p}.k_norm"), p)
        cos, sin, fused = table
        if fused and not in_op:
            offset = self._rotary_offset(p)
            q, k = fused_rope(b, q, cos, sin, offset, p), fused_rope(b, k, cos, sin, offset, p)
        elif not fused:
            q = self._merge(rope(b, self._split(q, c.n_heads, p), cos, sin, c.head_dim // 2, p), p)
            k = self._merge(rope(b, self._split(k, c.n_kv_heads, p), cos, sin, c.head_dim // 2, p), p)
        if attn.kv_quant is not None:
            k, v = kv_rounding(b, attn, self._split(k, c.n_kv_heads, p), self._split(v, c.n_kv_heads, p), p, head_axis=2)
            k, v = self._merge(k, p), self._merge(v, p)
        return q, k, v


def attention_emitter(model: Transformer, spec, b: GraphBuilder) -> AttentionEmitter:
    """The emitter ``spec.fused_attention`` asks for."""
    return (FusedAttention if spec.fused_attention else StandardAttention)(model, spec, b)
