"""``paged_kv``: record the serving plan (block size, KV dtype, block count) in the artifact.

It changes no weights. It resolves the plan against the model: the KV dtype (the model's, or
the FP8 cache an earlier pass declared in ``context.manifest_extras["kv_cache"]``, so run it
after that pass; an INT8 cache is held in the model dtype, ``resolve_kv_dtype``) and the number of blocks the memory budget buys, and stores the result as
``manifest["serving"]`` for ``serving.Engine.from_artifact``.
"""
from __future__ import annotations

import torch

from compiler.deploy.serving_plan import KV_DTYPES, ServingPlan, bytes_per_block, resolve_kv_dtype
from compiler.errors import ConfigError
from compiler.pipeline import Pass, PassContext, PassReport, register_pass


@register_pass
class PagedKVPass(Pass):
    name = "paged_kv"
    Options = ServingPlan
    provides = frozenset({"serving_plan"})

    def scope(self, config) -> str:
        return "config"  # reads the config and dtype only: a streamed compile runs it on the model's shell

    def run(self, model: torch.nn.Module, context: PassContext) -> PassReport:
        plan: ServingPlan = self.options
        c = model.config
        model_dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
        try:
            kv_dtype = resolve_kv_dtype(plan.kv_dtype, model_dtype, context.manifest_extras.get("kv_cache"))
        except ConfigError as e:
            raise ConfigError(f"paged_kv: {e}") from None
        heads, dim, values = c.kv_cache_layout
        per_block = bytes_per_block(plan.block_size, c.n_layers, heads, dim, KV_DTYPES[kv_dtype], values)
        num_blocks = plan.num_blocks or max(1, int(plan.kv_memory_mb * 2**20) // per_block)
        resolved = {**plan.to_dict(), "kv_dtype": kv_dtype, "num_blocks": num_blocks}
        context.manifest_extras["serving"] = resolved
        report = PassReport(self.name)
        report.metrics = {"num_blocks": num_blocks, "block_size": plan.block_size, "kv_dtype": kv_dtype,
                          "kv_cache_mib": round(num_blocks * per_block / 2**20, 2),
                          "max_cached_tokens": num_blocks * plan.block_size}
        return report
