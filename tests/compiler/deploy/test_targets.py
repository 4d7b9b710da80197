"""The target registry: one registration per backend gives both what the target runs and its lowering,
whose result carries the notes the CLI prints."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from compiler.deploy import targets
from compiler.deploy.lowering import lower
from compiler.deploy.targets import LowerResult, Target, check_formats, get_target, register_target
from compiler.errors import ConfigError
from compiler.options import option


@dataclass(frozen=True)
class KnobOptions:
    knob: int = option(1, "How far to turn the knob.")


def no_int4(module: str, fmt: dict) -> str | None:
    return "int4 is not run here" if fmt.get("format") == "int4" else None


def lower_knob(artifact, out, opts: KnobOptions, force: bool) -> LowerResult:
    return LowerResult(out, [f"{artifact.name} lowered with the knob at {opts.knob}"], {"as float": 3})


@pytest.fixture
def registry(monkeypatch):
    """An empty registry for the test (the built-in targets are left as they were)."""
    monkeypatch.setattr(targets, "TARGETS", {})


def test_one_registration_gives_the_checks_and_the_lowering(registry, tmp_path):
    register_target(Target("knob", "a test double", no_int4, lower_knob, KnobOptions))
    assert get_target("knob").option_names() == ["knob"]
    with pytest.raises(ConfigError, match="target 'knob' cannot run layers.0.mlp.up_proj: int4 is not run here"):
        check_formats("knob", {"layers.0.mlp.up_proj": {"format": "int4", "group_size": 32}})
    result = lower(tmp_path / "art", "knob", tmp_path / "out", {"knob": 7})
    assert result == LowerResult(tmp_path / "out", ["art lowered with the knob at 7"], {"as float": 3})


def test_a_refusal_says_each_reason_once_with_how_many_layers_it_stops(registry):
    register_target(Target("knob", "a test double", no_int4, lower_knob, KnobOptions))
    formats = {f"layers.{i}.mlp.up_proj": {"format": "int4", "group_size": 32} for i in range(30)}
    with pytest.raises(ConfigError) as e:
        check_formats("knob", formats | {"layers.0.mlp.down_proj": {"format": "int8"}})
    assert str(e.value) == "target 'knob' cannot run layers.0.mlp.up_proj (and 29 more layers): int4 is not run here"


def test_unknown_targets_and_options_are_one_line_errors(registry, tmp_path):
    register_target(Target("knob", "a test double", no_int4, lower_knob, KnobOptions))
    with pytest.raises(ConfigError, match="unknown target 'knb'; did you mean 'knob'"):
        lower(tmp_path, "knb", tmp_path / "out")
    with pytest.raises(ConfigError, match="lower target 'knob': unknown option 'soc'"):
        lower(tmp_path, "knob", tmp_path / "out", {"soc": "Ascend910B3"})


def test_options_must_be_a_dataclass(registry):
    with pytest.raises(TypeError, match="Options must be a dataclass"):
        register_target(Target("knob", "a test double", no_int4, lower_knob, dict))


def test_every_built_in_target_lowers():
    import backends  # noqa: F401  (registers them)

    assert set(targets.TARGETS) >= {"ascend", "gguf", "onnx", "triton", "vllm"}
    for target in targets.TARGETS.values():
        assert callable(target.check) and callable(target.lower) and target.option_names() is not None
