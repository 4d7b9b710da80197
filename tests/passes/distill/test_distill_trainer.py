"""The training loop: exact resume, non-finite skips, checkpoint retention, projections, checkpointing, configs."""
import copy
import json

import pytest
import torch
from distill_helpers import int4_copy, random_sequences, tiny_model

from compiler.errors import CheckpointError, ConfigError
from passes.distill.checkpoint import list_checkpoints, load_checkpoint_dir
from passes.distill.config import DistillOptions
from passes.distill.data import PackedLoader, pack_sequences, teacher_sequences
from passes.distill.errors import TrainingDivergedError
from passes.distill.students import freeze_codes, make_qat_student
from passes.distill.trainer import Distiller, WarmupCosine

FAST = dict(steps=6, seq_len=16, batch_size=4, lr=1e-2, warmup_steps=1, eval_windows=1, eval_len=16)


def qat_pair(tie=False, scales_only=False):
    teacher = tiny_model(tie=tie)
    student = int4_copy(teacher)
    make_qat_student(student, learn_qparams=True)
    if scales_only:
        freeze_codes(student)
    return teacher, student


class Interrupt(Exception):
    pass


def _interrupt_at(step):
    def hook(s, record):
        if s == step:
            raise Interrupt
    return hook


def _metrics(path):
    drop = ("tokens_per_s", "step_s")
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in path.read_text().splitlines()]


@pytest.mark.parametrize("tie, scales_only", [(False, False), (True, False), (False, True)])
def test_interrupted_and_resumed_run_is_bitwise_equal(tmp_path, tie, scales_only):
    opts = DistillOptions(**FAST, checkpoint_every=2, grad_accum=2, e2e_params="scales" if scales_only else "all")
    seqs = random_sequences()
    teacher, student = qat_pair(tie, scales_only)
    full = copy.deepcopy(student)
    Distiller(teacher, full, seqs, opts, tmp_path / "full").train()

    part = copy.deepcopy(student)
    with pytest.raises(Interrupt):
        Distiller(teacher, part, seqs, opts, tmp_path / "part", on_step=_interrupt_at(3)).train()
    assert [p.name for p in list_checkpoints(tmp_path / "part" / "checkpoints")] == ["step-000002"]
    resumed = copy.deepcopy(student)  # a fresh process would rebuild the initial student, then load
    result = Distiller(teacher, resumed, seqs, opts, tmp_path / "part").train(resume=True)
    assert result.resumed_from == 2 and result.steps == 6
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert _metrics(tmp_path / "full" / "metrics.jsonl") == _metrics(tmp_path / "part" / "metrics.jsonl")


def test_resume_refuses_changed_settings(tmp_path):
    teacher, student = qat_pair()
    seqs = random_sequences()
    Distiller(teacher, copy.deepcopy(student), seqs, DistillOptions(**FAST, checkpoint_every=2), tmp_path).train()
    changed = DistillOptions(**{**FAST, "lr": 1e-3}, checkpoint_every=2)
    with pytest.raises(ConfigError, match="lr was 0.01"):
        Distiller(teacher, student, seqs, changed, tmp_path).train(resume=True)
    more_data = DistillOptions(**FAST, checkpoint_every=2, generated_sequences=4)
    with pytest.raises(ConfigError, match="generated_sequences was 0, now 4"):
        Distiller(teacher, student, seqs, more_data, tmp_path).train(resume=True)
    other_text = DistillOptions(**FAST, checkpoint_every=2, train_corpora=["extra.txt"])
    with pytest.raises(ConfigError, match=r"train_corpora was \[\], now \['extra.txt'\]"):
        Distiller(teacher, student, seqs, other_text, tmp_path).train(resume=True)


def test_checkpoint_retention_keeps_the_newest(tmp_path):
    teacher, student = qat_pair()
    (tmp_path / "checkpoints" / ".step-000099.tmp-x").mkdir(parents=True)  # a crashed write: never listed
    opts = DistillOptions(**FAST, checkpoint_every=1, keep_checkpoints=2)
    Distiller(teacher, student, random_sequences(), opts, tmp_path).train()
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-000005", "step-000006"]
    model_state, optim_state, meta, rng = load_checkpoint_dir(tmp_path / "checkpoints" / "step-000006")
    assert meta["step"] == 6 and meta["position"] == {"epoch": 1, "cursor": 8}
    assert "rng.torch" in rng and set(meta["rng"]) == {"python", "numpy"}
    assert optim_state["state"] and all("exp_avg" in s for s in optim_state["state"].values())
    assert "student.layers.0.mlp.up_proj.weight" in model_state


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    teacher, student = qat_pair()
    opts = DistillOptions(**FAST, checkpoint_every=3)
    Distiller(teacher, copy.deepcopy(student), random_sequences(), opts, tmp_path).train()
    (tmp_path / "checkpoints" / "step-000006" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="unreadable training checkpoint"):
        Distiller(teacher, student, random_sequences(), opts, tmp_path).train(resume=True)


class NaNInjector:
    """Test double: a forward hook that turns the student's logits into NaN at chosen steps."""

    def __init__(self, student, steps):
        self.steps, self.current = set(steps), 1
        student.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.current in self.steps and module.training:
            logits, hidden = output
            return logits * float("nan"), hidden
        return output

    def on_step(self, step, record):
        self.current = step + 1


def test_non_finite_step_is_skipped_counted_and_logged(tmp_path):
    teacher, student = qat_pair()
    nan = NaNInjector(student, {3})
    seen = {}

    def on_step(step, record):
        if step == 2:
            seen["before"] = copy.deepcopy(student.state_dict())
        if step == 3:
            seen["after"] = copy.deepcopy(student.state_dict())
        nan.on_step(step, record)

    result = Distiller(teacher, student, random_sequences(), DistillOptions(**FAST), tmp_path, on_step).train()
    assert result.steps == 6 and result.skipped == 1
    for name, t in seen["before"].items():
        assert torch.equal(t, seen["after"][name]), f"{name} changed on a skipped step"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert records[-1]["skipped_total"] == 1
    assert all(torch.isfinite(p).all() for p in student.parameters())


def test_too_many_non_finite_steps_stop_and_keep_the_last_good_checkpoint(tmp_path):
    teacher, student = qat_pair()
    nan = NaNInjector(student, range(5, 100))
    opts = DistillOptions(**{**FAST, "steps": 20}, checkpoint_every=2, max_consecutive_skips=3)
    good = {}

    def on_step(step, record):
        if step == 4:
            good.update({k: v.clone() for k, v in student.state_dict().items()})
        nan.on_step(step, record)

    with pytest.raises(TrainingDivergedError, match="4 steps in a row"):
        Distiller(teacher, student, random_sequences(), opts, tmp_path, on_step).train()
    found = list_checkpoints(tmp_path / "checkpoints")
    assert found[-1].name == "step-000004"
    model_state, _, meta, _ = load_checkpoint_dir(found[-1])
    for name, t in good.items():
        assert torch.equal(model_state[f"student.{name}"], t), name


def _mse_on(d, seqs):
    with torch.no_grad():
        _, t_hidden = d.teacher(seqs, return_hidden=True)
        _, mapped = d.model(seqs)
        return sum(((m - t_hidden[t]) ** 2).mean().item() for m, (_, t) in zip(mapped, d.layer_map))


def test_projection_path_for_a_narrower_student(tmp_path):
    teacher = tiny_model(dim=32)
    student = tiny_model(seed=3, dim=16)
    seqs = random_sequences()
    d = Distiller(teacher, student, seqs, DistillOptions(**{**FAST, "steps": 10}, alpha=0.0, beta=1.0), tmp_path)
    proj = d.module.projections
    assert proj is not None and len(proj.maps) == 2 and proj.maps[0].weight.shape == (32, 16)
    before_w, before_mse = proj.maps[0].weight.clone(), _mse_on(d, seqs)
    d.train()
    assert not torch.equal(before_w, proj.maps[0].weight)
    assert _mse_on(d, seqs) < 0.9 * before_mse
    assert not any("projections" in k for k in student.state_dict())  # projections are training-only


def test_gradient_checkpointing_gives_the_same_gradients():
    teacher, student = qat_pair()
    seqs = random_sequences()
    grads = []
    for ckpt in (False, True):
        d = Distiller(teacher, copy.deepcopy(student), seqs, DistillOptions(**FAST, gradient_checkpointing=ckpt))
        d.optimizer.zero_grad()
        d._micro_step(seqs[:4], 1.0)
        grads.append([p.grad.clone() for p in d.params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_trains(tmp_path):
    teacher, student = qat_pair()
    result = Distiller(teacher, student, random_sequences(), DistillOptions(**FAST, precision="bf16"), tmp_path).train()
    assert result.skipped == 0 and result.last["loss"] > 0


def test_warmup_then_cosine():
    s = WarmupCosine(warmup=2, total=10, min_ratio=0.1)
    assert [s(0), s(1)] == [0.5, 1.0]
    assert s(2) == pytest.approx(1.0) and s(10) == pytest.approx(0.1)
    assert s(6) == pytest.approx(0.55)


def test_loader_order_is_seeded_and_resumable():
    seqs = pack_sequences(torch.arange(100), 10)
    a = PackedLoader(seqs, seed=0)
    first = [a.next_batch(3) for _ in range(5)]  # crosses an epoch boundary
    b = PackedLoader(seqs, seed=0)
    b.next_batch(3)
    c = PackedLoader(seqs, seed=0, position=copy.deepcopy(b.position))
    for want in first[1:]:
        assert torch.equal(c.next_batch(3), want)
    assert sorted(torch.cat(first[:4])[:10, 0].tolist()) == list(range(0, 100, 10))  # an epoch is a permutation


def test_teacher_sequences_continue_pool_prompts_with_the_teachers_text():
    teacher = tiny_model()
    pool = torch.arange(64).repeat(4)
    a = teacher_sequences(teacher, pool, 6, 24, seed=0, prompt_len=4, batch_size=4)
    again = teacher_sequences(teacher, pool, 6, 24, seed=0, prompt_len=4, batch_size=4)
    assert a.shape == (6, 24) and torch.equal(a, again)
    assert all(torch.equal(row[:4], pool[int(row[0]):int(row[0]) + 4]) for row in a)  # prompts cut from the pool
    with torch.no_grad():  # a sharp teacher's samples are likely under its cache-less forward
        teacher.lm_head.weight.mul_(100)
        sharp = teacher_sequences(teacher, pool, 6, 24, seed=0, prompt_len=4)
        probs = torch.softmax(teacher(sharp)[:, 3:-1], -1).gather(-1, sharp[:, 4:, None])
    assert probs.min() > 0.01 and probs.mean() > 0.9


@pytest.mark.parametrize("bad, match", [
    (dict(steps=0), "steps must be >= 1"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(alpha=0.0, beta=0.0, gamma=0.0), "nothing to train"),
    (dict(temperature=0.0), "temperature"),
    (dict(warmup_steps=10, steps=5), "warmup_steps"),
    (dict(layer_map=[[0]]), "layer_map"),
    (dict(min_lr_ratio=2.0), "min_lr_ratio"),
    (dict(hidden_norm="layer"), "hidden_norm.*rms.*none"),
    (dict(block_epochs=-1), "block_epochs must be >= 0"),
    (dict(block_lr=0.0), "block_lr must be > 0"),
    (dict(generated_sequences=-1), "generated_sequences must be >= 0"),
    (dict(train_corpora=["pydoc"]), "train_corpora repeats a corpus"),
    (dict(e2e_params="weights"), "e2e_params"),
])
def test_bad_options(bad, match):
    from compiler.options import parse_options

    with pytest.raises(ConfigError, match=match):
        parse_options(DistillOptions, bad, "distill")


def test_bad_model_pairs():
    teacher = tiny_model()
    with pytest.raises(ConfigError, match="vocabulary"):
        Distiller(teacher, tiny_model(vocab=32), random_sequences(), DistillOptions(**FAST))
    with pytest.raises(ConfigError, match="out of range"):
        Distiller(teacher, tiny_model(), random_sequences(), DistillOptions(**FAST, layer_map=[[0, 5]]))
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        pack_sequences(torch.arange(10), 16)


def test_train_corpora_add_their_pools_never_their_evaluation_regions(byte_tokenizer, tmp_path):
    from passes.distill.api import training_sequences
    from passes.distill.data import corpus_tokens

    extra = tmp_path / "extra.txt"
    extra.write_text("abcdefgh" * 70 + "01234567" * 30)  # its evaluation region (last 30%) is all digits
    options = DistillOptions(seq_len=32, train_corpora=[str(extra)])
    pool = corpus_tokens(byte_tokenizer, "pydoc").pool
    seqs = training_sequences(byte_tokenizer, options, pool)
    own = pack_sequences(pool, 32)
    extra_pool = corpus_tokens(byte_tokenizer, str(extra)).pool
    assert torch.equal(seqs[:len(own)], own) and len(seqs) == len(own) + len(extra_pool) // 32
    digits = set(byte_tokenizer("01234567", add_special_tokens=False)["input_ids"])
    assert not digits & set(seqs[len(own):].flatten().tolist())
