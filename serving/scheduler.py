"""Iteration-level scheduling with chunked prefill, prefix hits and preemption by recompute.

Each step (after vLLM v1's scheduler) spends a token budget of ``max_num_batched_tokens``:

1. running requests first, in arrival order: one token for a decode, the rest of the prompt
   (or as much as the budget allows) for a prefill still in progress. When the pool cannot
   supply their blocks, the most recently admitted running request is preempted: its blocks
   are freed and it goes back to the front of the queue to recompute later (its tokens so far
   are kept, so greedy output is unchanged; the prefix cache often makes recompute cheap).
2. then, if nobody was preempted this step, waiting requests in order while the budget, the
   ``max_num_seqs`` limit and the free blocks allow; each starts from its longest cached prefix.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.kv_manager import KVCacheManager
from serving.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class SchedulerStats:
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    num_cached_prompt_tokens: int = 0  # of which served from the prefix cache
    num_computed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    num_preemptions: int = 0
    max_running: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            alloc = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            while alloc is None:
                victim = self.running.pop()  # the most recent; never one already scheduled (those are before i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                alloc = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if alloc is None:
                break
            out.scheduled.append((req, n))
            out.copies += alloc.copies
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_computed = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            n = min(req.num_tokens - num_computed, budget)
            alloc = self.kv.allocate_slots(req.request_id, num_computed, n, hits)
            if alloc is None:
                break  # first come, first served: no overtaking by smaller requests
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                self.stats.num_prompt_tokens += len(req.prompt_token_ids)
                self.stats.num_cached_prompt_tokens += num_computed
                req.metrics.num_cached_prompt_tokens = num_computed
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            out.copies += alloc.copies
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.forget(req.request_id)
