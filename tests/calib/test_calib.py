"""Corpora, the 70/15/15 split protocol, seeded calibration windows and perplexity."""
import json
import math

import pytest
import torch

from calib import (
    CorpusError,
    calibration_windows,
    corpus_parts,
    evaluation_windows,
    load_corpus_text,
    perplexity,
    split_tokens,
)


def test_pydoc_corpus_is_sorted_topics():
    from pydoc_data import topics

    text = load_corpus_text("pydoc")
    first = sorted(topics.topics)[0]
    assert text.startswith(topics.topics[first]) and len(text) > 400_000


def test_stdlib_docs_corpus_is_the_docstrings_of_its_modules():
    import argparse
    import inspect

    from calib.corpus import STDLIB_MODULES

    text = load_corpus_text("stdlib-docs")
    assert text.startswith(inspect.getdoc(argparse)) and STDLIB_MODULES[0] == "argparse"
    assert f"ArgumentParser\n{inspect.getdoc(argparse.ArgumentParser)}" in text
    assert "pydoc" not in text[:1000] and len(text) > 150_000 and text == load_corpus_text("stdlib-docs")


def test_file_folder_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    assert load_corpus_text(str(tmp_path / "a.txt")) == "alpha"
    assert load_corpus_text(str(tmp_path)) == "alpha\n\nbeta"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "one", "body": "x"}) + "\n\n" + json.dumps({"text": "two", "body": "y"}) + "\n")
    assert load_corpus_text(str(rows)) == "one\n\ntwo"
    assert load_corpus_text(f"{rows}:body") == "x\n\ny"


@pytest.mark.parametrize("content, spec_suffix, message", [
    ('{"text": "a"}\nnot json\n', "", r"rows.jsonl:2: not valid JSON"),
    ('{"body": "a"}\n', "", r"no field 'text'"),
    ("", "", "is empty"),
])
def test_bad_jsonl(tmp_path, content, spec_suffix, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(content)
    with pytest.raises(CorpusError, match=message):
        load_corpus_text(str(rows) + spec_suffix)


def test_missing_and_unsupported(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        load_corpus_text(str(tmp_path / "nope.txt"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(CorpusError, match="unsupported type"):
        load_corpus_text(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no .txt"):
        load_corpus_text(str(tmp_path / "empty"))


def test_split_and_windows():
    split = split_tokens(list(range(1000)))
    assert split.pool.tolist() == list(range(700)) and split.evaluation[0].item() == 700
    a = calibration_windows(split.pool, 5, 64, seed=3)
    assert a.shape == (5, 64) and torch.equal(a, calibration_windows(split.pool, 5, 64, seed=3))
    assert not torch.equal(a, calibration_windows(split.pool, 5, 64, seed=4))
    assert int(a.max()) < 700  # never drawn from the evaluation region
    w = evaluation_windows(split.evaluation, 2, eval_len=64)
    assert w[0, 0].item() == 700 and w[1, 0].item() == 764
    with pytest.raises(ValueError, match="fewer than the 3"):
        evaluation_windows(split.evaluation, 3, eval_len=64)


def test_a_mixture_draws_equal_shares_from_each_pool_and_never_from_their_held_out_regions():
    a, b = split_tokens(list(range(1000))), split_tokens(list(range(10_000, 12_000)))
    mixed = calibration_windows([a.pool, b.pool], 7, 64, seed=3)
    first, second = mixed[:4], mixed[4:]  # 7 = 4 + 3: the first pool takes the remainder
    assert torch.equal(first, calibration_windows(a.pool, 4, 64, seed=3))
    assert torch.equal(second, calibration_windows(b.pool, 3, 64, seed=3))
    assert int(first.max()) < 700 and 10_000 <= int(second.min()) and int(second.max()) < 11_400
    assert torch.equal(calibration_windows([a.pool], 5, 64, seed=3), calibration_windows(a.pool, 5, 64, seed=3))


def test_corpus_parts(tmp_path):
    assert corpus_parts("pydoc") == ["pydoc"] and corpus_parts("pydoc+stdlib-docs") == ["pydoc", "stdlib-docs"]
    plus = tmp_path / "c++.txt"
    plus.write_text("text")
    assert corpus_parts(str(plus)) == [str(plus)]  # an existing path is one corpus
    with pytest.raises(CorpusError, match="an empty name in the mixture"):
        corpus_parts("pydoc+")
    assert load_corpus_text(str(plus)) == "text"
    with pytest.raises(CorpusError, match="mixes corpora, which only \\[calibration\\] corpus does"):
        load_corpus_text("pydoc+stdlib-docs")  # evaluation and distillation read one corpus


def test_validation_region_is_apart_from_the_reported_one():
    split = split_tokens(list(range(1000)))
    assert split.evaluation.tolist() == list(range(700, 850)) and split.validation.tolist() == list(range(850, 1000))
    assert split.region("evaluation") is split.evaluation and split.region("validation") is split.validation
    v = evaluation_windows(split.region("validation"), 2, eval_len=64)
    assert v[0, 0].item() == 850 and not set(v.flatten().tolist()) & set(split.evaluation.tolist())
    with pytest.raises(ValueError, match="unknown split 'test'"):
        split.region("test")


def test_perplexity_of_a_known_distribution():
    V = 8
    windows = torch.randint(0, V, (3, 10))

    def uniform(x):
        return torch.zeros(*x.shape, V)

    result = perplexity(uniform, windows)
    assert result["tokens"] == 27 and math.isclose(result["ppl"], V, rel_tol=1e-6)


def test_perplexity_rejects_nan():
    with pytest.raises(FloatingPointError):
        perplexity(lambda x: torch.full((*x.shape, 4), float("nan")), torch.zeros(1, 5, dtype=torch.long))
