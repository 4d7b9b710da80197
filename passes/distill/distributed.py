"""Scale-out on torch.distributed as launched by ``torchrun`` (no home-made engine).

Backend by device: gloo on CPU, NCCL on CUDA, HCCL on Ascend when ``torch_npu`` imports. Replicated
training wraps the student in ``DistributedDataParallel``; ``fsdp=True`` shards it with FSDP2
(``fully_shard`` per decoder layer, then the root) for models that do not fit one device.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _device_and_backend(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

        if torch.npu.is_available():
            torch.npu.set_device(local_rank)
            return torch.device("npu", local_rank), "hccl"
    return torch.device("cpu"), "gloo"


def setup_distributed() -> DistEnv:
    """Join the process group ``torchrun`` describes in the environment; a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = _device_and_backend(local_rank)
    if world == 1:
        return DistEnv(0, 1, device)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return DistEnv(dist.get_rank(), world, device)


def wrap_for_training(module: nn.Module, env: DistEnv, fsdp: bool) -> nn.Module:
    """DDP (or FSDP2 when asked) around ``module`` under torchrun; ``module`` itself otherwise."""
    if not env.distributed:
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in module.student.layers:
            fully_shard(layer)
        return fully_shard(module)
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if env.device.type == "cpu" else [env.device.index]
    return DistributedDataParallel(module, device_ids=device_ids)


def all_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean of a tensor over ranks (for logging: every rank sees the same numbers)."""
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value)
        value /= env.world_size
    return value


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
