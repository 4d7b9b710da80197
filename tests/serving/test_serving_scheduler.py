"""The scheduler without a model: admission, token budget, preemption order, cancel, sequence cap."""
from __future__ import annotations

import torch

from serving.kv_manager import KVCacheManager
from serving.request import Request, RequestStatus
from serving.scheduler import Scheduler
from serving.types import SamplingParams


def make(num_blocks=8, block_size=4, budget=64, max_seqs=8):
    return Scheduler(KVCacheManager(num_blocks, block_size), budget, max_seqs)


def req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), [], None, torch.device("cpu"), 0)


def run_step(s, sampled_token=7):
    """What the engine does after the forward: advance progress, append a token where all are computed."""
    out = s.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(sampled_token)
    return out


def test_admission_waits_for_free_blocks():
    s = make(num_blocks=4)
    a, b = req("a", 12), req("b", 8)  # a takes 3 blocks, b needs 2
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["a"] and list(s.waiting) == [b]
    s.finish(a)
    out = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["b"]


def test_budget_chunks_prefill_and_decodes_go_first():
    s = make(num_blocks=16, budget=6)
    a, b = req("a", 3), req("b", 10)
    s.add(a)
    s.add(b)
    assert [(r.request_id, n) for r, n in run_step(s).scheduled] == [("a", 3), ("b", 3)]
    assert [(r.request_id, n) for r, n in run_step(s).scheduled] == [("a", 1), ("b", 5)]
    assert [(r.request_id, n) for r, n in run_step(s).scheduled] == [("a", 1), ("b", 2)]


def test_preempts_the_most_recent_running_request():
    s = make(num_blocks=4, block_size=2)
    a, b, c = req("a", 2), req("b", 2), req("c", 3)  # 1 + 1 + 2 blocks: the pool is full
    for r in (a, b, c):
        s.add(r)
    run_step(s)
    assert s.kv.num_free_blocks == 0
    out = run_step(s)  # a needs a second block for its decode: c (most recent) is preempted
    assert out.preempted == [c] and c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.waiting[0] is c and [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    assert s.stats.num_preemptions == 1
    s.finish(a)
    s.finish(b)
    out = run_step(s)  # c comes back and recomputes prompt + its sampled token
    assert out.scheduled == [(c, 4)] and c.output_token_ids == [7, 7]


def test_cancel_frees_blocks_of_running_and_waiting():
    s = make(num_blocks=4)
    a, b = req("a", 12), req("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(b)  # waiting
    s.finish(a)  # running
    assert not s.has_unfinished() and s.kv.num_free_blocks == 4
    s.kv.pool.check_invariants()


def test_max_num_seqs_caps_the_running_set():
    s = make(num_blocks=32, max_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 3))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2
