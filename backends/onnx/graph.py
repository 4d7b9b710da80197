"""Build the decoder as an ONNX graph with ``onnx.helper``, straight from the model's modules.

Two graphs share one set of weights (see ``export.py``):

    prefill  input_ids [B, T] -> logits [B, T, V], present_key.i / present_value.i [B, Hkv, L, D]
    decode   input_ids [B, T], past_len int64 [1], past_key.i / past_value.i [B, Hkv, L, D]
             -> logits [B, T, V], present_key.i / present_value.i [B, Hkv, L, D]

L is the cache's maximum length (contiguous layout, position p lives at index p). Prefill writes
the new keys at 0..T-1 and zero-pads to L; decode writes them at past_len..past_len+T-1 with
ScatterElements (or, when T is statically 1 as for ATC, with a Where on a one-slot mask, which
keeps every shape static) and attends over all L keys under a mask (key j visible when j <= the query's
position, and within the sliding window when the model has one). Building the graph by hand
rather than through torch.onnx.export keeps every op on a short, known list — which ATC needs.

The layer follows the model's ``ArchSpec`` as ``compiler/model`` does: q/k RMSNorm per head
(Qwen3, Gemma 3), Gemma's (1 + w) norms around each sub-block, √dim embedding scale, GeGLU,
per-layer windows with one mask per window and per-layer RoPE tables (``rope_index``), Gemma's
query_pre_attn_scalar and logit soft-capping; the shared pieces are in ``ops.py``, the MLP and the
routed experts (Qwen3-MoE, Mixtral) in ``ffn.py``. Which architectures lower: ``export.py``.

An FP8 KV cache (``compiler/formats/fp8_kv.py``: the model's ``Attention.kv_quant``) is lowered
exactly: new K (after the rotary embedding) and V are rounded through the FP8 grid with the
artifact's scales before they reach the cache outputs (``kv_rounding.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import TensorProto, helper

from backends.onnx.ffn import feed_forward
from backends.onnx.kv_rounding import kv_rounding
from backends.onnx.ops import MS_DOMAIN, ONNX_DTYPES, OPSET, GraphBuilder, fused_rope, linear, rms_norm, rope
from compiler.model.transformer import Transformer

# OPSET and GraphBuilder live in ops.py; callers (tests, the Ascend lowering) import them from here too.
# MatMulNBits' accuracy_level: the lowest precision ONNX Runtime may compute in. 0: the input's
# type (float32: dequantize and float32 FMA), 1 float32, 2 float16, 3 bfloat16, 4 int8 (each
# block of the activations quantized to int8, then integer dot products: VNNI on x86).
MATMULNBITS_ACCURACY_LEVELS = (0, 1, 2, 3, 4)
# The default: int8 compute decodes SmolLM2 INT4 several times faster than level 0 on this CPU,
# for ~6e-3 relative error per layer (measured under load with benchmarks/onnx_decode.py; not yet in the benchmarks doc); exports
# that must match the torch reference to float32 rounding ask for 0.
DEFAULT_ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class GraphSpec:
    """What to build: ``kind`` prefill|decode; ``batch``/``seq`` None means a dynamic dim.

    ``dequantize`` exports every quantized layer as a float MatMul of its dequantized weight
    (the Ascend path); otherwise INT4 layers become com.microsoft ``MatMulNBits`` with
    ``accuracy_level`` (``MATMULNBITS_ACCURACY_LEVELS``). ``fused_rotary``: the rotary embedding as
    com.microsoft RotaryEmbedding (``ops.fused_rope``), for ONNX Runtime; else standard ops.
    """

    kind: str
    max_len: int
    dtype: str = "float32"
    batch: int | None = None
    seq: int | None = None
    dequantize: bool = False
    accuracy_level: int = 0
    fused_rotary: bool = False


class DecoderGraph:
    """Emits one graph (prefill or decode) for ``model`` according to ``spec``."""

    def __init__(self, model: Transformer, spec: GraphSpec, builder: GraphBuilder | None = None):
        self.model, self.spec, self.c = model, spec, model.config
        self.b = builder or GraphBuilder(spec.dtype, spec.accuracy_level)
        self.decode = spec.kind == "decode"
        self._key_pos: str | None = None  # decode: Range(0, L), every cache slot
        self._slot: str | None = None
        self._positions_out: str | None = None  # [T] this call's absolute positions
        self._scatter_index: str | None = None  # decode: ScatterElements' indices into the cache
        self._diff: str | None = None  # [T, Lk] query position minus key position
        self._masks: dict[int | None, str] = {}  # by attention window (None: full causal)

    def build(self) -> onnx.ModelProto:
        b = self.b
        x = b.op("Gather", [b.fweight("embed_tokens.weight", self.model.embed_tokens.weight), "input_ids"], "/embed")
        if self.c.spec.scale_embeddings:  # Gemma: times sqrt(dim), the factor rounded to the graph dtype (torch: the weight dtype)
            x = b.op("Mul", [x, b.fconst(self.model.embed_tokens.scale, "/embed")], "/embed")
        positions = self._positions()
        ropes = self._rope_tables(positions)
        outputs = []
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            mask = self._mask(positions, attn.sliding_window)
            x, present = self._layer(x, layer, i, ropes[attn.rope_index], mask)
            outputs += present
        x = rms_norm(b, x, self.model.norm, "norm")
        logits = self._head(x)
        cap = self.c.final_logit_softcapping
        if cap is not None:  # cap * tanh(logits / cap), in the model's dtype as Transformer.logits
            logits = b.op("Mul", [b.op("Tanh", [b.op("Div", [logits, b.fconst(cap, "/logits")], "/logits")], "/logits"),
                                  b.fconst(cap, "/logits")], "/logits")
        b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="/logits/Identity"))
        return self._model(outputs)

    def _head(self, x: str) -> str:
        """lm_head. A float head tied to the embedding (SmolLM2, Gemma 3) reads the embedding's own
        initializer through a Transpose, so weights.data holds the [V, dim] matrix once (ONNX Runtime
        folds the Transpose when it loads the graph)."""
        head, b = self.model.lm_head, self.b
        if type(head) is nn.Linear and head.weight is self.model.embed_tokens.weight and head.bias is None:
            return b.op("MatMul", [x, b.op("Transpose", ["embed_tokens.weight"], "lm_head", perm=[1, 0])], "lm_head")
        return linear(b, x, head, "lm_head", self.spec.dequantize)

    # -- graph-wide values ------------------------------------------------------------------
    def _positions(self) -> str:
        """Absolute positions [T] of this call's tokens: past_len + arange(T)."""
        b = self.b
        seq = b.op("Gather", [b.op("Shape", ["input_ids"], "/positions"), b.const(1, "/positions")], "/positions", axis=0)
        pos = b.op("Range", [b.const(0, "/positions"), seq, b.const(1, "/positions")], "/positions")
        self._positions_out = b.op("Add", [pos, "past_len"], "/positions") if self.decode else pos
        return self._positions_out

    def _rope_tables(self, positions: str) -> list[tuple[str, str, bool]]:
        """(cos, sin, fused) for each RoPE base the model has (``Attention.rope_index``: Gemma 3's
        sliding layers read table 1). The tables are the torch model's own rope() over every cache
        position, so values match bit for bit. ``fused``: com.microsoft RotaryEmbedding's half tables
        [L, D / 2], read at this call's offset (one op per q or k instead of six); else this call's rows
        of the full tables, [T, D]. A table whose two halves differ (not rotate-half RoPE) is never fused."""
        table_pos = torch.arange(self.spec.max_len)[None]
        cos, sin = self.model.rope(table_pos, torch.float32)  # [1, R, L, D]
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
            tables.append((b.op("Gather", [cos_t, positions], "/rope", axis=0),
                           b.op("Gather", [sin_t, positions], "/rope", axis=0), False))
        return tables

    def _mask(self, positions: str, window: int | None) -> str:
        """Boolean [T, Lk]: key j is visible to query t when 0 <= pos[t] - j (< window); one per window."""
        if window in self._masks:
            return self._masks[window]
        b = self.b
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

    # -- one decoder layer ------------------------------------------------------------------
    def _layer(self, x: str, layer: nn.Module, i: int, rope_table: tuple[str, str, bool], mask: str) -> tuple[str, list[str]]:
        """One ``DecoderLayer``: pre-norm attention and feed-forward on the residual stream; with
        Gemma's sandwich norms each sub-block's output is normalised before its add."""
        b, p = self.b, f"layers.{i}"
        attn_out, present = self._attention(rms_norm(b, x, layer.input_layernorm, f"{p}.input_layernorm"),
                                            layer.self_attn, i, rope_table, mask)
        ffn_scope = f"{p}.{layer.ffn_name}"
        act = self.c.spec.activation
        if layer.sandwich:
            h = b.op("Add", [x, rms_norm(b, attn_out, layer.post_attention_layernorm, f"{p}.post_attention_layernorm")], p)
            m = feed_forward(b, rms_norm(b, h, layer.pre_feedforward_layernorm, f"{p}.pre_feedforward_layernorm"),
                             layer.ffn, act, ffn_scope, self.spec.dequantize)
            m = rms_norm(b, m, layer.post_feedforward_layernorm, f"{p}.post_feedforward_layernorm")
        else:
            h = b.op("Add", [x, attn_out], p)
            m = feed_forward(b, rms_norm(b, h, layer.post_attention_layernorm, f"{p}.post_attention_layernorm"),
                             layer.ffn, act, ffn_scope, self.spec.dequantize)
        return b.op("Add", [h, m], p), present

    def _heads(self, x: str, n_heads: int, scope: str) -> str:
        """[B, T, H*D] -> [B, H, T, D]."""
        b = self.b
        x = b.op("Reshape", [x, b.const([0, 0, n_heads, self.c.head_dim], scope)], scope)
        return b.op("Transpose", [x], scope, perm=[0, 2, 1, 3])

    def _attention(self, x: str, attn: nn.Module, i: int, rope_table: tuple[str, str, bool], mask: str):
        b, c, p, dq = self.b, self.c, f"layers.{i}.self_attn", self.spec.dequantize
        hd, n_rep = c.head_dim, c.n_heads // c.n_kv_heads
        q = self._heads(linear(b, x, attn.q_proj, f"{p}.q_proj", dq), c.n_heads, p)
        k = self._heads(linear(b, x, attn.k_proj, f"{p}.k_proj", dq), c.n_kv_heads, p)
        v = self._heads(linear(b, x, attn.v_proj, f"{p}.v_proj", dq), c.n_kv_heads, p)
        if c.spec.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's D channels, before RoPE
            q, k = rms_norm(b, q, attn.q_norm, f"{p}.q_norm"), rms_norm(b, k, attn.k_norm, f"{p}.k_norm")
        cos, sin, fused = rope_table
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
        scores = b.op("Where", [mask, scores, b.fconst(np.finfo(b.np_dtype).min, p)], p)
        probs = b.op("Softmax", [scores], p, axis=-1)
        out = b.op("MatMul", [probs, b.op("Unsqueeze", [values, b.const([2], p)], p)], p)  # [B, Hkv, rep, T, D]
        out = b.op("Reshape", [out, b.const([0, c.n_heads, -1, hd], p)], p)
        out = b.op("Transpose", [out], p, perm=[0, 2, 1, 3])
        out = b.op("Reshape", [out, b.const([0, 0, c.n_heads * hd], p)], p)
        return linear(b, out, attn.o_proj, f"{p}.o_proj", dq), [f"present_key.{i}", f"present_value.{i}"]

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
            slots = b.op("Reshape", [self._positions_out, b.const([1, 1, -1, 1], "/slots")], "/slots")
            self._scatter_index = b.op("Expand", [slots, b.op("Shape", [new], "/slots")], "/slots")
        return self._scatter_index

    def _slot_mask(self) -> str:
        """Boolean [1, 1, L, 1], true at cache slot past_len (built once, shared by every layer)."""
        if self._slot is None:
            b = self.b
            slot = b.op("Equal", [self._key_pos, "past_len"], "/slot")
            self._slot = b.op("Reshape", [slot, b.const([1, 1, self.spec.max_len, 1], "/slot")], "/slot")
        return self._slot

    # -- model proto ------------------------------------------------------------------------
    def _model(self, present: list[str]) -> onnx.ModelProto:
        c, spec, dt = self.c, self.spec, ONNX_DTYPES[self.spec.dtype]
        batch = spec.batch if spec.batch is not None else "batch"
        seq = spec.seq if spec.seq is not None else "seq"
        cache_shape = [batch, c.n_kv_heads, spec.max_len, c.head_dim]
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])]
        if self.decode:
            inputs.append(helper.make_tensor_value_info("past_len", TensorProto.INT64, [1]))
            for i in range(c.n_layers):
                inputs += [helper.make_tensor_value_info(f"past_{w}.{i}", dt, cache_shape) for w in ("key", "value")]
        outputs = [helper.make_tensor_value_info("logits", dt, [batch, seq, c.vocab_size])]
        outputs += [helper.make_tensor_value_info(name, dt, cache_shape) for name in present]
        graph = helper.make_graph(self.b.nodes, f"qcompile_{spec.kind}", inputs, outputs,
                                  initializer=list(self.b.weights.values()) + self.b.consts)
        opsets = [helper.make_opsetid("", OPSET)]
        if any(n.domain == MS_DOMAIN for n in self.b.nodes):
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="qcompile")
        model.ir_version = 8  # ONNX 1.12-era IR: what ATC and older runtimes read
        return model


def build_graph(model: Transformer, spec: GraphSpec) -> onnx.ModelProto:
    """The ONNX model for ``spec`` (weights inline; ``export.py`` moves them to external data)."""
    with torch.no_grad():
        return DecoderGraph(model, spec).build()
