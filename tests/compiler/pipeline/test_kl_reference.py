"""``compare_to_reference`` on tiny models, and the reference file it saves: a round trip, edits and
mismatches refused with one line."""
import struct

import pytest
import torch

from compiler.errors import ConfigError
from compiler.io.kl_reference import read_reference
from compiler.io.load import load_checkpoint
from compiler.pipeline.evaluate import check_reference_options, compare_to_reference


@pytest.fixture
def models(tiny_checkpoint_with_tokenizer):
    """A float model and a candidate near it (its weights with 2% noise)."""
    path, _ = tiny_checkpoint_with_tokenizer("llama")
    reference, candidate = load_checkpoint(path), load_checkpoint(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in candidate.model.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn_like(p))
    return reference, candidate


@pytest.fixture
def saved(models, tmp_path):
    """The live statistics, and the reference file saved while computing them."""
    reference, candidate = models
    path = tmp_path / "ref.kld"
    live = compare_to_reference(candidate, reference, windows=2, save_reference=path)
    return path, live


def test_a_reference_file_gives_the_live_statistics(models, saved):
    path, live = saved
    _, candidate = models
    from_file = compare_to_reference(candidate, path, windows=2)
    assert live["tokens"] == from_file["tokens"] == 2 * 511
    assert 0 < live["kld_mean"] < 1 and 0.5 < live["same_top"] < 1
    assert from_file["reference"] == str(path) and from_file["reference_model"] == live["reference_model"]
    for key, value in live.items():
        if key.startswith("kld"):  # from the file's 16-bit log-probs: 1.3e-4 nats each
            assert from_file[key] == pytest.approx(value, abs=5e-4), key
        elif isinstance(value, float):  # the target's log-prob and the top token are stored exactly
            assert from_file[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    info = read_reference(path).info
    assert (info.corpus, info.split, info.windows, info.window_length, info.vocab_size) == ("pydoc", "evaluation", 2, 512, 320)


def test_a_reference_file_is_safetensors_with_its_metadata(saved):
    from safetensors import safe_open

    path, _ = saved
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert f.get_slice("codes").get_shape() == [2 * 511, 320] and f.get_slice("codes").get_dtype() == "U16"
        assert f.get_tensor("tokens").shape == (2, 512)
    assert {"corpus", "split", "windows", "window_length", "vocab_size", "reference", "tokens_sha256"} <= set(meta)


def test_candidate_equal_to_reference(models):
    reference, _ = models
    result = compare_to_reference(reference, reference, windows=1)
    assert result["kld_mean"] == 0 and result["kld_max"] == 0 and result["same_top"] == 1 and result["rms_dp"] == 0


def header_and_data(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return raw[8:8 + length], raw[8 + length:]


def edited(path, edit):
    header, data = header_and_data(path)
    if edit == "a code":
        data = data[:-5000] + bytes([data[-5000] ^ 1]) + data[-4999:]
    elif edit == "the metadata":  # the same length, so the file still parses
        header = header.replace(b'"corpus":"pydoc"', b'"corpus":"pydox"')
    elif edit == "truncated":
        data = data[: len(data) // 2]
    return b"plain text, no header" if edit == "not safetensors" else struct.pack("<Q", len(header)) + header + data


def test_an_edited_file_is_refused(saved, tmp_path):
    path, _ = saved
    for edit in ("a code", "the metadata", "truncated", "not safetensors"):
        copy = tmp_path / f"{edit}.kld"
        copy.write_bytes(edited(path, edit))
        with pytest.raises(ConfigError, match="checksum mismatch|not a qcompile reference file") as e:
            read_reference(copy)
        assert "\n" not in str(e.value) and str(copy) in str(e.value), edit
    read_reference(path)  # the original still reads


def test_other_windows_are_refused(models, saved):
    path, _ = saved
    _, candidate = models
    for windows, split, message in [
        (1, "evaluation", "holds 2 windows of 512 tokens, this evaluation 1 of 512: pass --windows 2"),
        (2, "validation", "it was saved on corpus 'pydoc', evaluation region, this evaluation reads corpus 'pydoc', "
                          "validation region: pass --corpus pydoc --split evaluation"),
    ]:
        with pytest.raises(ConfigError, match="reference file") as e:
            compare_to_reference(candidate, path, windows=windows, split=split)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_options_that_need_a_reference_model(saved, tmp_path):
    path, _ = saved
    with pytest.raises(ConfigError, match="is already a reference file"):
        check_reference_options(path, tmp_path / "again.kld", None)
    with pytest.raises(ConfigError, match="--plot needs a reference"):
        check_reference_options(None, None, tmp_path / "kld.png")
    with pytest.raises(ConfigError, match="--save-reference needs a reference"):
        check_reference_options(None, tmp_path / "ref.kld", None)


def test_nan_logits_raise_and_leave_no_file(models, tmp_path):
    reference, candidate = models
    with torch.no_grad():
        next(candidate.model.parameters()).fill_(float("nan"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FloatingPointError, match="the candidate model produced NaN or Inf logits"):
        compare_to_reference(candidate, reference, windows=1, save_reference=out / "ref.kld")
    assert list(out.iterdir()) == []  # neither the file nor its temp


def test_plot_writes_a_png(models, tmp_path):
    reference, candidate = models
    compare_to_reference(candidate, reference, windows=1, plot=tmp_path / "kld.png")
    assert (tmp_path / "kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

