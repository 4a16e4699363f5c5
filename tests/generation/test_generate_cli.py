"""`qpalette generate` and `qpalette.generate`: text in, streamed text out, clear errors."""

import json

from typer.testing import CliRunner

import qpalette
from qpalette.cli import app
from qpalette.generation.text import encode_prompts
from qpalette.runtime.loading import load_model

runner = CliRunner()


def test_cli_streams_one_prompt_and_writes_json(tiny_llama_dir, tmp_path):
    out = tmp_path / "g.json"
    res = runner.invoke(app, ["generate", str(tiny_llama_dir), "--prompt", "Hello", "-n", "12", "--device", "cpu",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["format"] == "qpalette.generate/1" and len(r["tokens"][0]) == 12 and r["steps"] == 11
    assert r["texts"][0] in res.output and "decode steps at" in res.output and "CUDA graphs off" in res.output
    model, tok = load_model(tiny_llama_dir, "cpu")
    assert r["texts"][0] == tok.decode(r["tokens"][0], skip_special_tokens=True)


def test_cli_batch_of_samples(tiny_llama_dir, tmp_path):
    out = tmp_path / "g.json"
    args = ["generate", str(tiny_llama_dir), "-p", "ab", "-p", "xyz", "--batch", "2", "-n", "6", "--temperature",
            "1.0", "--seed", "3", "--device", "cpu", "--json", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["prompts"] == ["ab", "ab", "xyz", "xyz"] and r["tokens"][0] != r["tokens"][1]
    assert "--- 3: 'xyz'" in res.output
    runner.invoke(app, args)
    assert json.loads(out.read_text())["tokens"] == r["tokens"]  # the seed reproduces the samples


def test_cli_errors(tiny_llama_dir):
    for extra, msg in ((["--top-p", "0"], "--top-p"), (["--chat"], "no chat template"), (["-n", "0"], "≥ 1"),
                       (["--batch", "0"], "--batch"), (["--device", "tpu"], "bad --device"),
                       (["-n", "5000"], "positions")):
        res = runner.invoke(app, ["generate", str(tiny_llama_dir), "-p", "hi", "--device", "cpu", *extra])
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, (extra, res.output)
    res = runner.invoke(app, ["generate", "/no/such/model", "-p", "hi"])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_chat_template_wraps_prompts(tiny_llama_dir):
    _, tok = load_model(tiny_llama_dir, "cpu")
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert encode_prompts(tok, ["hi"], chat=True) == [tok("[user]hi[assistant]")["input_ids"]]
    assert encode_prompts(tok, ["hi"]) == [tok("hi")["input_ids"]]


def test_library_call_streams_what_it_returns(tiny_llama_dir):
    model, tok = load_model(tiny_llama_dir, "cpu")
    pieces: dict[int, str] = {0: "", 1: ""}

    def on_text(i, piece):
        pieces[i] += piece

    g = qpalette.generate(model, tok, ["one", "a longer two"], max_new_tokens=10, on_text=on_text)
    assert [len(t) for t in g.tokens] == [10, 10] or any(g.result.finished)
    assert [pieces[0], pieces[1]] == g.texts
    by_path = qpalette.generate(str(tiny_llama_dir), None, ["one", "a longer two"], max_new_tokens=10, device="cpu")
    assert by_path.tokens == g.tokens
