"""`qpalette bench` on CPU (harness only; GPU speed is measured through the device tool)."""

import json

from test_compress import run_compress
from typer.testing import CliRunner

from qpalette.cli import app

runner = CliRunner()


def test_bench_original_and_compressed(tiny_llama_dir, tmp_path):
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    for d in (tiny_llama_dir, tmp_path / "q"):
        out = tmp_path / "b.json"
        res = runner.invoke(app, ["bench", str(d), "--batch-sizes", "1,3", "--gen-len", "6",
                                  "--prompt-len", "5", "--device", "cpu", "--json", str(out)])
        assert res.exit_code == 0, res.output
        r = json.loads(out.read_text())
        assert [row["batch_size"] for row in r["rows"]] == [1, 3]
        assert all(row["steps_timed"] == 4 and row["tok_per_s"] > 0 for row in r["rows"])
        assert all(row["loop_step_s"] > 0 and abs(row["loop_tok_per_s"] * row["loop_step_s"] - 1) < 1e-9 for row in r["rows"])
        assert "forward loop" in res.output
        assert r["quantized"] == (d != tiny_llama_dir)


def test_bench_errors(tmp_path):
    for args, msg in ((["bench", "/no/such/dir"], "no such"),
                      (["bench", "smollm2-135m", "--batch-sizes", "x"], "--batch-sizes"),
                      (["bench", "smollm2-135m", "--device", "tpu"], "bad --device")):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, res.output
