"""The Python example of docs/api.md runs as written (on the tiny model instead of SmolLM2)."""

import re
import shutil
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_api_example_runs(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    model = shutil.copytree(tiny_llama_dir, tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)  # the example chats: give the tiny model a template
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok.save_pretrained(model)
    code = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S)[1]
    assert 'MODEL = "smollm2-135m"' in code
    code = code.replace('MODEL = "smollm2-135m"', f'MODEL = "{model}"')
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOCS), "exec"), {})
    out = capsys.readouterr().out
    assert "tok/s" in out and "MB" in out
    assert (tmp_path / "qpalette-api-example" / "model" / "config.json").is_file()
