"""scripts/profile_generate.py's library (qpalette.measure.host_profile) on CPU: the harness only
(eager generate; the compiled path is what the GPU machine measures)."""

import json

from helpers import run_compress

from qpalette.measure.host_profile import PARTS, main, profile_models


def _check(r: dict, gen_len: int) -> None:
    s = r["step_ms"]
    assert r["mode"] == "eager" and not r["compiled"] and r["steps"] == gen_len - 1
    assert set(s) == set(r["step_median_ms"]) == {"total", *PARTS, "other"}
    assert len(r["repeat_step_ms"]) == 3 and r["repeat_step_ms"] == sorted(r["repeat_step_ms"])
    assert s["total"] > 0 and s["eager_forward"] > 0 and s["processors"] > 0 and s["criteria"] > 0
    assert abs(sum(v for k, v in s.items() if k != "total") - s["total"]) < 1e-6 * s["total"]
    assert s["other"] > -0.05 * s["total"]  # the parts are disjoint: what is left is not negative
    assert r["calls"]["eager_forward"] == r["steps"] and r["calls"]["compiled_call"] == 0
    assert not r["used_compiled_call"] and r["frames_compiled_while_profiling"] == 0
    assert r["generate_ms_per_step"] > 0 and r["loop_gpu_ms_per_step"] > 0 and r["loop_host_ms_per_call"] > 0
    assert 0 < len(r["top_tottime"]) <= 15 and all(t["tottime_ms_per_step"] >= 0 for t in r["top_tottime"])
    tp = r["torch_profiler"]
    assert tp["steps"] == r["steps"] and tp["top_self_cpu"] and tp["gpu_kernels_per_step"] == 0


def test_profile_fp16_and_compressed(tiny_llama_dir, tmp_path):
    q = tmp_path / "q"
    run_compress(tiny_llama_dir, q, scheme="nuq-4")
    out, gen_len = tmp_path / "out", 6
    records = profile_models([tiny_llama_dir, q], out, batch=1, prompt_len=5, gen_len=gen_len, device="cpu",
                             repeats=3)
    assert [r["quantized"] for r in records] == [False, True]
    for r in records:
        _check(r, gen_len)
        text = (out / f"{r['name']}_eager_cprofile.txt").read_text()
        assert "by tottime" in text and "by cumulative" in text
        assert json.loads((out / f"{r['name']}_eager_cprofile.json").read_text())["steps"] == gen_len - 1
        assert "Self CPU" in (out / f"{r['name']}_eager_torchprof.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["format"] == "qpalette.host_profile/1" and len(summary["records"]) == 2
    md = (out / "summary.md").read_text()
    assert all(f"| {r['name']} | eager |" in md for r in records)


def test_main_prints_summary(tiny_llama_dir, tmp_path, capsys):
    main([str(tiny_llama_dir), "--gen-len", "4", "--prompt-len", "3", "--device", "cpu", "--repeats", "3",
          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("generate") >= 1 and "eager forward" in out and "forward loop GPU" in out
    assert json.loads((tmp_path / "summary.json").read_text())["records"][0]["steps"] == 3
