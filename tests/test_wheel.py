"""`python -m build` makes a wheel that holds the kernels' sources and every shipped profile, installs
into a fresh virtual environment, and runs `qpalette palette`, a help example and the demo from
outside the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {  # source folder → where the wheel holds its files
    ROOT / "qpalette" / "runtime" / "cuda": "qpalette/runtime/cuda",
    ROOT / "profiles": "qpalette/_profiles",
}


def run(cmd: list, cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def shipped_files() -> set[str]:
    """Every file the source tree ships, as its path inside the wheel."""
    return {f"{inside}/{f.relative_to(folder).as_posix()}" for folder, inside in SHIPPED.items()
            for f in folder.rglob("*") if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (the build writes its scratch files beside them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("qpalette", "profiles"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp / "dist", src], tmp)
    (found,) = (tmp / "dist").glob("qpalette-*.whl")
    return found


def test_the_wheel_holds_the_kernels_and_the_profiles(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = shipped_files() - names
    assert not missing, sorted(missing)
    assert "qpalette/_profiles/reference/llama31_8b/config.json" in names
    assert any(n.endswith(".cu") for n in names) and "qpalette/cli.py" in names


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_source_tree(wheel, tiny_llama_dir, tmp_path):
    """A fresh venv (the system's packages visible, so torch is not downloaded again; the wheel's
    own dependencies must all be there: --no-index), then commands run from an empty folder."""
    venv = tmp_path / "venv"
    # without the venv's own (older) setuptools, which would hide the one torch requires
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp_path)
    py, exe = venv / "bin" / "python", venv / "bin" / "qpalette"
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "--quiet", wheel], tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QPALETTE_PROFILES")}
    env["QPALETTE_SHARED"] = str(tmp_path / "no-shared")  # the demo skips perplexity
    where = run([py, "-c", "import qpalette; print(qpalette.__file__)"], work, env).strip()
    assert Path(where).is_relative_to(venv), where  # the wheel's copy, not the source tree's
    assert run([exe, "--version"], work, env).startswith("qpalette ")
    assert "tcq-2.0" in run([exe, "palette"], work, env)
    run([exe, "plan", "qpalette:profiles/reference/llama31_8b", "-s",
         "qpalette:profiles/reference/llama31_8b_sensitivity.json", "-b", "3.25bits", "--no-plot"], work, env)
    assert (work / "plan.json").is_file()
    model = shutil.copytree(tiny_llama_dir, tmp_path / "tiny")
    _give_a_chat_template(model)
    out = run([py, ROOT / "scripts" / "demo.py", "--model", model, "--out", work / "demo"], work, env)
    assert "== summary ==" in out and (work / "demo" / "compressed" / "config.json").is_file()


def _give_a_chat_template(model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok.save_pretrained(model)
