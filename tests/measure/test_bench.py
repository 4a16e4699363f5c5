"""`qpalette bench` on CPU (harness only; GPU speed is measured on a CUDA machine)."""

import json

from helpers import run_compress
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
        assert all(row["decoder_tok_per_s"] > 0 and row["decoder_host_step_s"] > 0 and
                   row["decoder_cuda_graphs"] is False for row in r["rows"])
        assert "forward loop" in res.output and "decoder" in res.output
        assert r["quantized"] == (d != tiny_llama_dir) and r["format"] == "qpalette.bench/2"


def test_bench_some_ways(tiny_llama_dir, tmp_path):
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", str(tiny_llama_dir), "--batch-sizes", "2", "--gen-len", "5", "--prompt-len",
                              "4", "--device", "cpu", "--ways", "loop", "--json", str(out)])
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())["rows"][0]
    assert row["loop_tok_per_s"] > 0 and "tok_per_s" not in row and "decoder_tok_per_s" not in row
    assert "forward loop" in res.output and "decoder" not in res.output
    assert json.loads(out.read_text())["attention"] == "qpalette_sdpa"


def test_bench_with_transformers_attention(tiny_llama_dir, tmp_path):
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", str(tiny_llama_dir), "--batch-sizes", "1", "--gen-len", "4", "--prompt-len",
                              "3", "--device", "cpu", "--ways", "loop", "--attention", "sdpa", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["attention"] == "sdpa"


def test_bench_errors(tmp_path):
    for args, msg in ((["bench", "/no/such/dir"], "no such"),
                      (["bench", "smollm2-135m", "--batch-sizes", "x"], "--batch-sizes"),
                      (["bench", "smollm2-135m", "--device", "tpu"], "bad --device"),
                      (["bench", "smollm2-135m", "--compile-modes", "fast"], "--compile-modes"),
                      (["bench", "smollm2-135m", "--ways", "fast"], "--ways"),
                      (["bench", "smollm2-135m", "--attention", "flash"], "--attention")):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, res.output


def test_decode_loop_equals_generate(tiny_llama_dir):
    """The timed loop decodes what generate decodes: same logits at every step, same greedy tokens."""
    import torch

    from qpalette.measure.bench import DecodeLoop, random_prompt
    from qpalette.runtime.loading import load_model

    model, _ = load_model(tiny_llama_dir, "cpu", tokenizer=False)
    loop = DecodeLoop(model, batch=2, prompt_len=5, steps=6, seed=3)
    seen, forward = [], model.forward

    def recording(**kw):
        out = forward(**kw)
        seen.append(out.logits[:, -1])
        return out

    model.forward = recording  # what the loop's step calls through model(...)
    for _ in range(6):
        loop.step()
    del model.forward
    ids = random_prompt(model, 2, 5, seed=3)
    out = model.generate(ids, max_new_tokens=7, min_new_tokens=7, do_sample=False, cache_implementation="static",
                         disable_compile=True, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(torch.cat(loop.tokens, dim=1), out.sequences[:, 5:])
    for mine, theirs in zip(seen, out.logits[1:]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert len(seen) == 6 and loop.pos == 11
