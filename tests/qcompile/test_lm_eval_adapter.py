"""lm-evaluation-harness on qcompile models: the ``qcompile`` model (``qcompile/lm_eval.py``).

lm-eval's own tasks download their data from the Hugging Face hub, so the tasks here are defined in
the test, over local JSONL files: a multiple-choice task (``loglikelihood``), a perplexity task like
wikitext (``loglikelihood_rolling``) and a ``generate_until`` task. They run offline (the hub switched
off, no socket may leave the machine) on a tiny checkpoint, and every figure lm-eval got from the
adapter is checked against the model's logits computed here, directly.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

import qcompile
from qcompile.lm_eval import QCompileLM

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    {"question": "def add(a, b):", "choices": [" return a + b", " return a - b", " pass"], "answer": 0},
    {"question": "import os\nprint(os.", "choices": ["path", "getcwd()", "environ['HOME']"], "answer": 1},
    {"question": "for i in range(10):", "choices": ["\n    print(i)", " break", "\n    continue"], "answer": 0},
    {"question": "The module", "choices": [" provides", " is", " of the"], "answer": 2},
]
TEXTS = [
    {"text": "This module provides access to some variables used or maintained by the interpreter."},
    {"text": "Return a new sorted list from the items in iterable.\n\nTwo optional arguments may be given."},
]
PROMPTS = [{"prompt": "def f(x):"}, {"prompt": "import sys\n"}]
MAX_GEN_TOKS = 24
OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def local_dataset(name: str, rows: list[dict], root: Path) -> str:
    """The YAML lines that read ``rows`` from a local JSONL file as the test split."""
    data = write_jsonl(root / f"{name}.jsonl", rows)
    return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            f"  cache_dir: {json.dumps(str(root / 'hf-datasets'))}\ntest_split: test\n")


def write_tasks(root: Path, stop: str) -> list[str]:
    """Three tasks as lm-eval task YAMLs under ``root`` (its ``--include_path``)."""
    tasks = {
        "qc_choice": "output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
                     "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        # as lm-eval's wikitext task: the whole document scored, no prompt
        "qc_text": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: text\nmetric_list:\n"
                   "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "qc_gen": "output_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: ''\n"
                  f"generation_kwargs:\n  until: [{json.dumps(stop)}]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
                  "metric_list:\n  - metric: exact_match\n",
    }
    rows = {"qc_choice": QUESTIONS, "qc_text": TEXTS, "qc_gen": PROMPTS}
    for name, body in tasks.items():
        (root / f"{name}.yaml").write_text(f"task: {name}\n{local_dataset(name, rows[name], root)}{body}"
                                           "metadata:\n  version: 1.0\n")
    return list(tasks)


@pytest.fixture
def offline(monkeypatch):
    """The hub switched off, and any connection beyond this machine an error."""
    import datasets.config

    for name in OFFLINE_ENV:
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read once, when datasets is imported
    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"the test is offline: no connection to {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)


@pytest.fixture
def model(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer()
    return path, qcompile.load(path)


def log_probs(loaded, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1..T-1: one plain forward."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids]))[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def continuation_logprob(loaded, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log p over the continuation's tokens (context + continuation encoded whole, split where
    the context's own tokens end), and whether each is the argmax."""
    tok = loaded.tokenizer
    n = len(tok.encode(context))
    ids = tok.encode(context + continuation)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids]))[0].float()
    logp = torch.log_softmax(logits, -1)
    picked = [logp[t - 1, ids[t]] for t in range(n, len(ids))]
    greedy = all(int(logp[t - 1].argmax()) == ids[t] for t in range(n, len(ids)))
    return float(sum(picked)), greedy


def stop_string_of(text: str) -> str:
    """Two printable ASCII characters from the middle of ``text``, where the stop cuts it short."""
    for i in range(len(text) // 2, len(text) - 1):
        if text[i:i + 2].isascii() and text[i:i + 2].isprintable() and text.find(text[i:i + 2]) > 0:
            return text[i:i + 2]
    raise AssertionError(f"no ASCII stop string in {text!r}")


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_local_tasks_match_the_models_own_logits(model, tmp_path, offline):
    path, loaded = model
    greedy = [qcompile.generate(loaded, p["prompt"], max_tokens=MAX_GEN_TOKS) for p in PROMPTS]
    stop = stop_string_of(greedy[0])
    tasks = write_tasks(tmp_path, stop)

    results = simple_evaluate(model="qcompile", model_args=f"pretrained={path},batch_size=3", tasks=tasks,
                              task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)

    # loglikelihood: every (context, continuation) lm-eval asked for, scored as the logits say
    choice = samples(results, "qc_choice")
    assert len(choice) == len(QUESTIONS) and all(len(s["arguments"]) == 3 for s in choice)
    for s in choice:
        for (context, continuation), [(logprob, is_greedy)] in zip(s["arguments"], s["resps"]):
            expected, expected_greedy = continuation_logprob(loaded, context, continuation)
            assert logprob == pytest.approx(expected, rel=1e-4, abs=1e-4), (context, continuation)
            assert is_greedy == expected_greedy
        scores = [r[0][0] for r in s["resps"]]
        assert s["acc"] == float(scores.index(max(scores)) == s["target"])

    # loglikelihood_rolling: one window each, so the document's NLL after BOS
    bos = loaded.tokenizer.bos_token_id
    for s, doc in zip(samples(results, "qc_text"), TEXTS):
        [[logprob]] = s["resps"]
        expected = float(log_probs(loaded, [bos] + loaded.tokenizer.encode(doc["text"])).sum())
        assert logprob == pytest.approx(expected, rel=1e-4)
    words = sum(len(d["text"].split()) for d in TEXTS)  # lm-eval's word count: whitespace-separated
    total = sum(s["resps"][0][0] for s in samples(results, "qc_text"))
    assert results["results"]["qc_text"]["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)

    # generate_until: qcompile.generate's greedy text, cut at the stop string
    generated = [s["resps"][0][0] for s in samples(results, "qc_gen")]
    assert generated == [text.split(stop)[0] for text in greedy]
    assert len(generated[0]) < len(greedy[0])  # the stop string did cut it


def test_rolling_windows_and_left_truncation(model):
    """Past ``max_length`` tokens: lm-eval's disjoint windows, and contexts cut from the left."""
    path, loaded = model
    lm = QCompileLM(loaded, max_length=40, batch_size=2)
    tok = loaded.tokenizer
    text = "Return a new sorted list from the items in iterable; two optional arguments may be given."
    ids = tok.encode(text)
    assert 40 < len(ids) <= 80, len(ids)
    # Window 1: BOS and the first 39 tokens predict tokens 0..39. Window 2: the remaining tokens'
    # predictions, each from a full 40-token input (the 40 tokens before the last).
    first = log_probs(loaded, [tok.bos_token_id] + ids[:40]).sum()
    second = log_probs(loaded, ids[-41:])[-(len(ids) - 40):].sum()
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert rolling == pytest.approx(float(first + second), rel=1e-4)

    context, continuation = text[:60], text[60:]  # 62 tokens: the context loses its first 21
    whole = tok.encode(context + continuation)
    n_cont = len(whole) - len(tok.encode(context))
    [(logprob, _)] = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    assert logprob == pytest.approx(float(log_probs(loaded, whole[-41:])[-n_cont:].sum()), rel=1e-4)

def test_sampling_follows_the_request(model):
    """do_sample with a seed: the same seed gives the same text; greedy ignores it."""
    _, loaded = model
    lm = QCompileLM(loaded)

    def run(**kwargs):
        return lm.generate_until([Instance("generate_until", {}, ("def f(x):", {"until": [], "max_gen_toks": 12, **kwargs}), 0)])[0]

    greedy = qcompile.generate(loaded, "def f(x):", max_tokens=12)
    assert run() == greedy
    assert run(do_sample=True, temperature=1.0, seed=3) == run(do_sample=True, temperature=1.0, seed=3)
    assert run(do_sample=False, temperature=0.7, seed=3) == greedy
    with pytest.raises(ValueError, match="repetition_penalty"):
        run(repetition_penalty=1.1)


def test_the_command_line_runs_offline(model, tmp_path):
    """``python -m qcompile.lm_eval``: lm-eval's CLI with the ``qcompile`` model, the hub switched off."""
    path, _ = model
    write_tasks(tmp_path, "\n")
    out = tmp_path / "results"
    env = {**os.environ, **dict.fromkeys(OFFLINE_ENV, "1"), "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    run = subprocess.run([sys.executable, "-m", "qcompile.lm_eval", "--model", "qcompile",
                          "--model_args", f"pretrained={path}", "--tasks", "qc_choice,qc_text",
                          "--include_path", str(tmp_path), "--output_path", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    [written] = out.rglob("results_*.json")
    figures = json.loads(written.read_text())["results"]
    assert 0 <= figures["qc_choice"]["acc,none"] <= 1
    assert math.isfinite(figures["qc_text"]["word_perplexity,none"])


@pytest.mark.integration
def test_local_completions_on_qcompile_serve_vllm(tiny_checkpoint_with_tokenizer, tmp_path, offline):
    """lm-eval's ``local-completions`` model against ``qcompile serve --engine vllm`` (its server process,
    on 127.0.0.1) gives the figures the in-process ``qcompile`` model gives on the same artifact:
    vLLM's ``/v1/completions`` returns prompt log-probabilities (``echo`` with ``logprobs``)."""
    from backends.triton.runtime import free_port
    from backends.vllm.runtime import VllmOptions, VllmServer

    # head_dim 32: vLLM's CPU attention takes no head size of 16 (the fixture's default)
    path, _ = tiny_checkpoint_with_tokenizer("llama", num_attention_heads=2, num_key_value_heads=1)
    artifact = qcompile.compile(path, {"passes": []}, tmp_path / "artifact").path
    checkpoint = qcompile.lower(artifact, "vllm", tmp_path / "vllm").path
    loaded = qcompile.load(artifact)
    stop = stop_string_of(qcompile.generate(loaded, PROMPTS[0]["prompt"], max_tokens=MAX_GEN_TOKS))
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    tasks = write_tasks(tasks_dir, stop)

    def evaluate(model, model_args=None):
        results = simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks_dir)))
        return {task: [s["resps"] for s in samples(results, task)] for task in tasks}

    ours = evaluate(QCompileLM(loaded))
    server = VllmServer(VllmOptions(checkpoint, port=free_port(), served_name="tiny", extra_args=["--enforce-eager"]),
                        log_path=tmp_path / "vllm.log").start()
    try:
        served = evaluate("local-completions", {"base_url": f"http://{server.url}/v1/completions", "model": "tiny",
                                                "tokenizer_backend": "huggingface", "tokenizer": str(checkpoint),
                                                "max_length": 256})
    finally:
        server.stop()

    def logprobs(resps):  # per doc, per request, per repeat: (logprob, is_greedy), or a rolling logprob
        return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for doc in resps for r in doc]

    assert len(logprobs(served["qc_choice"])) == 3 * len(QUESTIONS) and len(logprobs(served["qc_text"])) == len(TEXTS)
    for task in ("qc_choice", "qc_text"):
        assert logprobs(served[task]) == pytest.approx(logprobs(ours[task]), rel=1e-3, abs=1e-3), task
    print({t: max(abs(a - b) for a, b in zip(logprobs(served[t]), logprobs(ours[t]))) for t in ("qc_choice", "qc_text")})
    assert served["qc_gen"] == ours["qc_gen"] and all(doc[0][0] for doc in ours["qc_gen"]), (served["qc_gen"], ours["qc_gen"])
