"""``modules_to_not_convert``: one matcher for every pass, and the error on a pattern naming nothing."""
import pytest

from compiler.errors import ConfigError
from compiler.model.config import ModelConfig
from compiler.pipeline.selection import (
    check_patterns,
    excluded_by,
    matches,
    meta_model,
    select_linears,
)

CONFIG = ModelConfig("LlamaForCausalLM", vocab_size=32, dim=16, n_layers=12, n_heads=2, n_kv_heads=1, intermediate_size=32)


@pytest.mark.parametrize("name, pattern, expected", [
    ("lm_head", "lm_head", True),
    ("layers.1.mlp.down_proj", "down_proj", True),  # a last component
    ("layers.1.mlp.down_proj", "mlp.down_proj", True),  # a run of them
    ("layers.3.self_attn.q_proj", "self_attn", True),  # a parent names its children
    ("layers.3.mlp.up_proj", "self_attn", False),
    ("layers.1.mlp.down_proj", "layers.1", True),
    ("layers.10.mlp.down_proj", "layers.1", False),  # whole components only
    ("layers.3.self_attn.q_proj", "layers.*.self_attn.*", True),  # a glob over the full name
    ("layers.3.mlp.down_proj", "layers.*.mlp.down_proj", True),
    ("layers.3.mlp.up_proj", "layers.*.mlp", True),  # a glob naming the parent
    ("layers.12.mlp.up_proj", "layers.1*", True),
    ("layers.2.mlp.up_proj", "layers.1*", False),
    ("layers.2.mlp.up_proj", "*_proj", True),
    ("layers.2.mlp.up_proj", "up", False),  # not a substring match
    ("layers.2.mlp.up_proj", "mlp.up", False),
    ("layers.2.mlp.up_proj", "Mlp", False),  # case-sensitive
])
def test_a_pattern_is_a_glob_over_whole_dotted_components(name, pattern, expected):
    assert matches(name, pattern) is expected


def test_select_linears_names_each_excluded_layer_with_its_pattern():
    model = meta_model(CONFIG)
    selected, excluded = select_linears(model, ["lm_head", "layers.1", "self_attn"])
    assert excluded["lm_head"] == "lm_head" and excluded["layers.1.mlp.up_proj"] == "layers.1"
    assert excluded["layers.1.self_attn.q_proj"] == "layers.1"  # the first pattern that names it
    assert excluded["layers.5.self_attn.o_proj"] == "self_attn"
    assert selected[:3] == ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"]
    assert len(selected) == 11 * 3 and not set(selected) & set(excluded)
    assert excluded_by("layers.0.mlp.up_proj", ["lm_head"]) is None


@pytest.mark.parametrize("pattern, hint", [
    ("layer.0", "did you mean 'layers.0'? "),
    ("mlp.down", "did you mean 'mlp.down_proj'? "),
    ("encoder.*", ""),
])
def test_a_pattern_naming_no_module_is_a_one_line_error(pattern, hint):
    model = meta_model(CONFIG)
    check_patterns(["lm_head", "embed_tokens", "layers.1*", "self_attn"], model)  # each names something
    with pytest.raises(ConfigError) as e:
        check_patterns(["lm_head", pattern], model)
    assert str(e.value) == (f"modules_to_not_convert pattern {pattern!r} matches no module ({hint}names look like "
                            "'layers.0.self_attn.q_proj'); fix or remove it")
