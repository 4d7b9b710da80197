"""``paged_kv``: record the serving plan (block size, KV dtype, block count) in the artifact.

It changes no weights. It plans the KV cache for the model (``plan_kv_cache``: the KV dtype, the
model's, or the FP8 E4M3 or INT8 cache an earlier pass declared in ``context.manifest_extras["kv_cache"]``;
and the number of blocks the memory budget buys) and records the resolved plan as
``manifest["serving"]``, which ``serving.Engine.from_artifact`` builds its cache from.
``kv_dtype = "float8_e4m3fn"`` requires the FP8 K/V scales of an fp8 pass with ``kv_cache_dtype =
"float8_e4m3fn"`` before it, ``kv_dtype = "int8"`` the INT8 ones of an int8 pass with
``kv_cache_dtype = "int8"``: declared as ``requires``, so a pipeline without them is refused
before any pass runs.
"""
from __future__ import annotations

import torch

from compiler.deploy.serving_plan import ServingPlan, plan_kv_cache
from compiler.pipeline import Pass, PassContext, PassReport, register_pass
from passes.fp8 import FP8_KV_CACHE
from passes.int8 import INT8_KV_CACHE


@register_pass
class PagedKVPass(Pass):
    name = "paged_kv"
    Options = ServingPlan
    provides = frozenset({"serving_plan"})

    def __init__(self, options: ServingPlan):
        super().__init__(options)
        # the cache stores codes with calibrated scales: an earlier pass must provide them
        needs = {"float8_e4m3fn": FP8_KV_CACHE, "int8": INT8_KV_CACHE}.get(options.kv_dtype)
        if needs:
            self.requires = frozenset({needs})

    def scope(self, model) -> str:
        return "config"  # reads the config and dtype only: a streamed compile runs it on the model's shell

    def run(self, model: torch.nn.Module, context: PassContext) -> PassReport:
        plan: ServingPlan = self.options
        model_dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
        kv = plan_kv_cache(plan, model.config, model_dtype, context.manifest_extras.get("kv_cache"))
        context.manifest_extras["serving"] = plan.resolved(kv).to_dict()
        report = PassReport(self.name)
        report.metrics = {"num_blocks": kv.num_blocks, "block_size": kv.block_size, "kv_dtype": kv.kv_dtype,
                          "kv_cache_mib": round(kv.mib, 2), "max_cached_tokens": kv.max_tokens}
        return report
