"""Build the decoder as an ONNX graph with ``onnx.helper``, straight from the model's modules.

Two graphs share one set of weights (see ``export.py``). With the standard attention
(``GraphSpec.fused_attention`` off: the ATC graphs, ``--no-fused-attention``):

    prefill  input_ids [B, T] -> logits [B, T, V], present_key.i / present_value.i [B, Hkv, L, D]
    decode   input_ids [B, T], past_len int64 [1], past_key.i / past_value.i [B, Hkv, L, D]
             -> logits [B, T, V], present_key.i / present_value.i [B, Hkv, L, D]

With GroupQueryAttention (ONNX Runtime's default), each row has its own length:

    prefill  input_ids [B, T], past_key.i / past_value.i (buffers; positions 0..T-1 are written)
             -> logits, present_key.i / present_value.i (the same buffers when bound so)
    decode   input_ids [B, T], past_lens int64 [B], past_key.i / past_value.i -> the same

L is the cache's maximum length (contiguous layout, position p lives at index p). How each kind
writes and reads the cache: ``attention.py``. Building the graph by hand rather than through
torch.onnx.export keeps every op on a short, known list — which ATC needs.

The layer follows the model's ``ArchSpec`` as ``compiler/model`` does: q/k RMSNorm per head
(Qwen3, Gemma 3), Gemma's (1 + w) norms around each sub-block, √dim embedding scale, GeGLU,
per-layer windows and RoPE tables (``rope_index``), Gemma's query_pre_attn_scalar and logit
soft-capping; the shared pieces are in ``ops.py``, attention in ``attention.py``, the MLP and the
routed experts (Qwen3-MoE, Mixtral) in ``ffn.py``, the FP8 KV cache's exact rounding in
``kv_rounding.py``. Which architectures lower: ``export.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
import torch
import torch.nn as nn
from onnx import TensorProto, helper

from backends.onnx.attention import AttentionEmitter, attention_emitter
from backends.onnx.ffn import feed_forward
from backends.onnx.ops import MS_DOMAIN, ONNX_DTYPES, OPSET, GraphBuilder, linear, rms_norm
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
    com.microsoft RotaryEmbedding (``ops.fused_rope``) or inside GroupQueryAttention, for ONNX
    Runtime; else standard ops. ``fused_attention``: attention as com.microsoft GroupQueryAttention
    with per-row lengths (``attention.py``); else standard ops. ``rotary_in_attention``: with both,
    the op applies the rotary embedding itself (``do_rotary``) rather than RotaryEmbedding nodes.
    """

    kind: str
    max_len: int
    dtype: str = "float32"
    batch: int | None = None
    seq: int | None = None
    dequantize: bool = False
    accuracy_level: int = 0
    fused_rotary: bool = False
    fused_attention: bool = False
    rotary_in_attention: bool = True


class DecoderGraph:
    """Emits one graph (prefill or decode) for ``model`` according to ``spec``."""

    def __init__(self, model: Transformer, spec: GraphSpec, builder: GraphBuilder | None = None):
        self.model, self.spec, self.c = model, spec, model.config
        self.b = builder or GraphBuilder(spec.dtype, spec.accuracy_level)
        self.decode = spec.kind == "decode"

    def build(self) -> onnx.ModelProto:
        b = self.b
        x = b.op("Gather", [b.fweight("embed_tokens.weight", self.model.embed_tokens.weight), "input_ids"], "/embed")
        if self.c.spec.scale_embeddings:  # Gemma: times sqrt(dim), the factor rounded to the graph dtype (torch: the weight dtype)
            x = b.op("Mul", [x, b.fconst(self.model.embed_tokens.scale, "/embed")], "/embed")
        attention = attention_emitter(self.model, self.spec, b)
        outputs = []
        for i, layer in enumerate(self.model.layers):
            x, present = self._layer(x, layer, i, attention)
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

    # -- one decoder layer ------------------------------------------------------------------
    def _layer(self, x: str, layer: nn.Module, i: int, attention: AttentionEmitter) -> tuple[str, list[str]]:
        """One ``DecoderLayer``: pre-norm attention and feed-forward on the residual stream; with
        Gemma's sandwich norms each sub-block's output is normalised before its add."""
        b, p = self.b, f"layers.{i}"
        attn_out, present = attention(rms_norm(b, x, layer.input_layernorm, f"{p}.input_layernorm"), layer.self_attn, i)
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

    # -- model proto ------------------------------------------------------------------------
    def _model(self, present: list[str]) -> onnx.ModelProto:
        c, spec, dt = self.c, self.spec, ONNX_DTYPES[self.spec.dtype]
        batch = spec.batch if spec.batch is not None else "batch"
        seq = spec.seq if spec.seq is not None else "seq"
        cache_shape = [batch, c.n_kv_heads, spec.max_len, c.head_dim]
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])]
        if self.decode and spec.fused_attention:
            inputs.append(helper.make_tensor_value_info("past_lens", TensorProto.INT64, [batch]))
        elif self.decode:
            inputs.append(helper.make_tensor_value_info("past_len", TensorProto.INT64, [1]))
        if self.decode or spec.fused_attention:
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
