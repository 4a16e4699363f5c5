"""The examples in `qpalette COMMAND --help` are valid command lines, and the cheap ones run as
written from any folder (they name shipped files as qpalette:profiles/...)."""

from __future__ import annotations

import shlex

import pytest
import typer
from typer.testing import CliRunner

from qpalette.cli import app

GROUP = typer.main.get_command(app)
# run as written, in this order, in an empty folder (the others need a model download or a GPU)
RUN = [
    "qpalette palette",
    "qpalette palette --family tcq --json -",
    "qpalette plan qpalette:profiles/reference/llama31_8b -s qpalette:profiles/reference/llama31_8b_sensitivity.json "
    "-b 3.25bits",
    "qpalette plan --show plan.json",
]


def examples() -> list[tuple[str, str]]:
    """(command name, example line) of every example in every command's help."""
    return [(name, line.strip()) for name, cmd in GROUP.commands.items()
            for line in (cmd.help or "").splitlines() if line.strip().startswith("qpalette ")]


def test_commands_have_examples():
    names = {name for name, _ in examples()}
    assert {"palette", "calibrate", "plan", "compress", "eval", "generate"} <= names


@pytest.mark.parametrize("name,line", examples())
def test_every_example_parses(name, line):
    words = shlex.split(line)
    assert words[:2] == ["qpalette", name]
    cmd = GROUP.commands[name]
    with cmd.make_context(name, words[2:]) as ctx:  # a bad option or value raises here
        assert ctx.params


def test_the_cheap_examples_run_as_written(tmp_path, monkeypatch):
    lines = [line for _, line in examples()]
    assert all(line in lines for line in RUN)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for line in RUN:
        res = runner.invoke(app, shlex.split(line)[1:])
        assert res.exit_code == 0, f"{line}\n{res.output}"
    assert (tmp_path / "plan.json").is_file()


def test_the_root_help_documents_exit_codes():
    out = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    assert "Exit codes: 0 done; 2 a user error" in out and "1 a bug" in out
