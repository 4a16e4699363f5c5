"""scripts/bench_decode.py on the tiny model (CPU): every variant timed into the results layout,
compressed copies removed, a cut run continued without re-timing what it measured."""

from __future__ import annotations

import json

import pytest
from helpers import load_script

from qpalette import api


def _script():
    return load_script("bench_decode")


def _args(model, tmp_path, *extra):
    return [str(model), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--device", "cpu",
            "--batch-sizes", "1", "--prompt-len", "4", "--gen-len", "4", *extra]


def test_variants_and_resume(tiny_llama_dir, tmp_path, capsys):
    from helpers import fake_sensitivity

    plan = tmp_path / "plan_fast.json"
    api.plan(str(tiny_llama_dir), "3.0bits", sensitivity=fake_sensitivity(tiny_llama_dir, tmp_path / "s.json"),
             output=plan)
    script = _script()
    assert script.main(_args(tiny_llama_dir, tmp_path, "--schemes", "2bit=tcq-2.0", "--plans", str(plan),
                                      "--no-lm-head")) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["bench_2bit.json", "bench_fast.json", "bench_fp16.json",
                                                     "plan_fast.json"]
    assert not list((tmp_path / "w").glob("q_*"))  # compressed copies deleted
    assert json.loads((out / "bench_2bit.json").read_text())["quantized"] is True
    assert json.loads((out / "bench_fp16.json").read_text())["quantized"] is False
    assert json.loads((out / "bench_fp16.json").read_text())["attention"] == "qpalette_sdpa"
    assert "× fp16" in capsys.readouterr().out
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    # continued: the measured variants are kept as they are, only the new one is timed
    assert script.main(_args(tiny_llama_dir, tmp_path, "--schemes", "2bit=tcq-2.0,3bit=tcq-3.0",
                                      "--no-lm-head")) == 0
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in stamps.items())
    assert (out / "bench_3bit.json").is_file()
    assert "2bit: measured already" in capsys.readouterr().out


@pytest.mark.parametrize("schemes", ["2bit", "=tcq-2.0"])
def test_bad_scheme_pair_is_a_usage_error(tmp_path, schemes):
    with pytest.raises(SystemExit) as e:
        _script().main(_args("unused", tmp_path, "--schemes", schemes))
    assert e.value.code == 2


@pytest.mark.parametrize("schemes", ["x=tcq-9.9", "x=tcq-2.0"])  # an unknown entry; lm_head's 257 rows uncodable
def test_a_user_mistake_is_an_error_line(tiny_llama_dir, tmp_path, capsys, schemes):
    assert _script().main(_args(tiny_llama_dir, tmp_path, "--schemes", schemes)) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not list((tmp_path / "w").glob("q_*"))


def test_a_finished_compressed_copy_is_timed_without_compressing_again(tiny_llama_dir, tmp_path, monkeypatch):
    """Cut between compress and bench: the next run times the copy it finds."""
    api.compress(str(tiny_llama_dir), "tcq-2.0", tmp_path / "w" / "q_2bit", random_codes=True, quiet=True)
    script = _script()

    def no_compress(*a, **k):
        raise AssertionError("compressed again")

    monkeypatch.setattr(script.api, "compress", no_compress)
    assert script.main(_args(tiny_llama_dir, tmp_path, "--schemes", "2bit=tcq-2.0", "--no-lm-head")) == 0
    assert (tmp_path / "out" / "bench_2bit.json").is_file() and not (tmp_path / "w" / "q_2bit").exists()


def test_keep_leaves_the_compressed_copy_for_later_tools(tiny_llama_dir, tmp_path):
    assert _script().main(_args(tiny_llama_dir, tmp_path, "--schemes", "2bit=tcq-2.0", "--no-lm-head", "--keep")) == 0
    assert (tmp_path / "w" / "q_2bit" / "qpalette-compress.json").is_file()


def test_transformers_attention(tiny_llama_dir, tmp_path):
    assert _script().main(_args(tiny_llama_dir, tmp_path, "--schemes", "", "--attention", "sdpa")) == 0
    assert json.loads((tmp_path / "out" / "bench_fp16.json").read_text())["attention"] == "sdpa"
