"""`--json FILE` means the same in every command that prints results; `-` is standard output;
`qpalette --version`."""

import json

from typer.testing import CliRunner

from qpalette.cli import app
from qpalette.version import __version__

runner = CliRunner()


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"qpalette {__version__}"


def test_json_to_stdout_is_pure_json_and_to_a_file_the_same(tiny_llama_dir, tmp_path):
    commands = {
        "palette": ["palette", "--family", "nuq"],
        "generate": ["generate", str(tiny_llama_dir), "-p", "hi", "-n", "4", "--device", "cpu"],
        "bench": ["bench", str(tiny_llama_dir), "--batch-sizes", "1", "--gen-len", "4", "--prompt-len", "3",
                  "--device", "cpu"],
        "compress": ["compress", str(tiny_llama_dir), "--scheme", "nuq-4", "-o", str(tmp_path / "q"), "-q"],
        "calibrate": ["calibrate", str(tiny_llama_dir), "-o", str(tmp_path / "s.json"), "-n", "2", "--seq-len", "16",
                      "--levels", "2", "--layers", "layers.0.mlp.down", "--device", "cpu", "-q"],
        "plan": ["plan", "qpalette:profiles/reference/llama31_8b", "-s",
                 "qpalette:profiles/reference/llama31_8b_sensitivity.json", "-b", "3bits", "-o", str(tmp_path / "p.json"),
                 "--no-plot"],
    }
    for name, args in commands.items():
        res = runner.invoke(app, [*args, "--json", "-"])
        assert res.exit_code == 0, (name, res.output)
        doc = json.loads(res.stdout)  # nothing but the JSON on stdout
        assert doc, name
        if name == "compress":
            args[args.index("-o") + 1] = str(tmp_path / "q2")
        out = tmp_path / f"{name}.json"
        res = runner.invoke(app, [*args, "--json", str(out)])
        assert res.exit_code == 0, (name, res.output)
        assert json.loads(out.read_text()).keys() == doc.keys() if isinstance(doc, dict) else len(doc)


def test_every_command_has_json():
    import typer

    for name, cmd in typer.main.get_command(app).commands.items():
        assert any("--json" in p.opts for p in cmd.params), name
