"""The command line is a thin layer: it reaches the pipeline only through the public API."""

import ast
from pathlib import Path

import qpalette

CLI = Path(qpalette.__file__).parent / "cli.py"
# what the CLI may import from qpalette: the API, its configs and errors, the version, and the
# atomic JSON write behind --json
ALLOWED = {"qpalette", "qpalette.api", "qpalette.config", "qpalette.errors", "qpalette.version", "qpalette.fileio"}


def test_the_cli_imports_only_the_public_api():
    tree = ast.parse(CLI.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("qpalette")} <= ALLOWED


def test_every_api_call_of_the_cli_is_exported():
    tree = ast.parse(CLI.read_text())
    called = {n.attr for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "api"}
    assert called and called <= set(qpalette.__all__)
