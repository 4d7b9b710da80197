"""One meaning per flag across subcommands: --json, --output-json, --device, comma lists."""
from __future__ import annotations

import json
import sys

import pytest
import typer

from compiler.errors import ConfigError
from qcompile.cli.options import check_device, parse_list


def _commands():
    from qcompile.cli import app

    def walk(command, path):
        if hasattr(command, "commands"):  # a group (typer may not subclass click.Group)
            for name, sub in command.commands.items():
                yield from walk(sub, f"{path} {name}")
        else:
            yield path, command

    yield from walk(typer.main.get_command(app), "qcompile")


def _option(command, flag):
    return next((p for p in command.params if flag in getattr(p, "opts", ())), None)


def test_a_flag_means_the_same_in_every_subcommand():
    helps = {"--json": set(), "--output-json": set()}
    devices = []
    for path, command in _commands():
        for flag in helps:
            if (p := _option(command, flag)) is not None:
                helps[flag].add(p.help)
                assert not p.is_flag or flag == "--json", path
        if (p := _option(command, "--device")) is not None:
            devices.append(path)
            assert "Compute device" in p.help, f"{path}: --device must be the compute device"
    assert len(helps["--json"]) == 1 and len(helps["--output-json"]) == 1, helps
    assert {"qcompile generate", "qcompile lower"} <= set(devices)
    with_json = {path for path, command in _commands() if _option(command, "--json")}
    assert {"qcompile compile", "qcompile eval", "qcompile inspect", "qcompile distill", "qcompile bench run"} <= with_json


def test_lists_are_comma_lists_and_repeatable():
    assert parse_list(["1,2", " 3 ", "4,"], int, "--concurrency") == [1, 2, 3, 4]
    assert parse_list("0.5,2", float, "--request-rate") == [0.5, 2.0]
    assert parse_list(None, int, "--x") == [] and parse_list([], str, "--x") == []
    with pytest.raises(ConfigError, match=r"--concurrency '1,two': give a comma list of int values"):
        parse_list(["1", "two"], int, "--concurrency")


def test_device_is_the_compute_device():
    assert check_device(None) is None and check_device("cuda:1") == "cuda:1" and check_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"--device 'gpu': use one of cpu, cuda, npu"):
        check_device("gpu")


def test_eval_json_on_stdout_and_in_a_file(tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch, capsys):
    from qcompile.cli import main

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    monkeypatch.setattr(sys, "argv", ["qcompile", "eval", str(path), "--windows", "1", "--json",
                                      "--output-json", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    printed = json.loads(captured.out)  # stdout holds the JSON object and nothing else
    assert printed == json.loads((tmp_path / "r.json").read_text())
    assert printed["tokens"] == 511 and printed["ppl"] > 1 and "wrote" in captured.err
