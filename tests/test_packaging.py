"""The wheel carries every subpackage of the source tree (pyproject lists them by hand)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_subpackage():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qpalette").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
    assert listed - on_disk == {"qpalette._profiles"}
