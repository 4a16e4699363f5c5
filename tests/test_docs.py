"""The Python examples of docs/api.md and the README run as written (on the tiny model instead of SmolLM2)."""

import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "api.md"


def chatty_tiny_model(tiny_llama_dir, tmp_path):
    """A copy of the tiny model with a chat template (the examples chat)."""
    from transformers import AutoTokenizer

    model = shutil.copytree(tiny_llama_dir, tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok.save_pretrained(model)
    return model


def test_api_example_runs(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    model = chatty_tiny_model(tiny_llama_dir, tmp_path)
    code = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S)[1]
    assert 'MODEL = "smollm2-135m"' in code
    code = code.replace('MODEL = "smollm2-135m"', f'MODEL = "{model}"')
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOCS), "exec"), {})
    out = capsys.readouterr().out
    assert "tok/s" in out and "MB" in out
    assert (tmp_path / "qpalette-api-example" / "model" / "config.json").is_file()


def test_readme_api_example_runs(tiny_llama_dir, tmp_path, monkeypatch):
    model = chatty_tiny_model(tiny_llama_dir, tmp_path)
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\nimport qpalette\n# (.*?)```", text, re.S)[0].strip("`").removeprefix("python\n")
    assert code.count('"smollm2-135m"') == 3
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace('"smollm2-135m"', repr(str(model))), "README.md", "exec"), {})
    assert json.loads((tmp_path / "plan.json").read_text())["config"]["palette"] == ["nuq", "vq"]
    assert (tmp_path / "smollm2-q" / "config.json").is_file()
