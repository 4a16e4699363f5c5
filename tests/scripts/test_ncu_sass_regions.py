"""scripts/ncu_sass_regions.py on a hand-made ncu source-page export: launches split, windows of
executed instructions with their share of the samples and top stall reasons, bad input."""

from __future__ import annotations

from helpers import load_script

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_long_sb","stall_long_sb (Not Issued)"\n'


def _export(tmp_path):
    def row(addr, src, samples, executed, wait, long_sb):
        return f'"{addr}","{src}","{samples}","{executed}","{wait}","{long_sb}","0"\n'
    text = ('"Kernel Name","void qp::gemv_kernel<A>(qp::GemvParams)",\n' + HEADER
            + row("0x0", "      LDG.E.128 R4, desc[UR4][R2.64]", 10, 5, 0, 10)
            + row("0x10", "      @P0 HMMA.16816.F32 R8, R4, R6, R8", 30, 5, 20, 0)
            + row("0x20", "      BRA 0x0", 0, 0, 0, 0)
            + row("0x30", "      STG.E R2, R8", 60, 5, 60, 0)
            + '"Kernel Name","void qp::gemv_kernel<B>(qp::GemvParams)",\n' + HEADER
            + row("0x0", "      EXIT", 1, 1, 1, 0))
    path = tmp_path / "sass.csv"
    path.write_text(text)
    return path


def test_windows_sum_samples_of_executed_instructions(tmp_path, capsys):
    script = load_script("ncu_sass_regions")
    path = _export(tmp_path)
    first, second = script.launches(path)
    assert len(first) == 4 and len(second) == 1
    got = script.windows(first, 2)
    assert [(w["first"], w["instructions"], w["samples"]) for w in got] == [(0, 2, 40), (2, 1, 60)]
    assert got[0]["reasons"] == [(20, "wait"), (10, "long_sb")] and got[0]["ops"] == ["HMMA", "LDG"]
    assert got[1]["ops"] == ["STG"]
    assert script.main([str(path), "--window", "2", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "launch 0 of 2: 4 instructions, 100 samples" in out
    assert " 40.0%" in out and " 60.0%" in out and "STG.E R2, R8" in out.splitlines()[-1]


def test_missing_launch_or_file_exits_2(tmp_path, capsys):
    script = load_script("ncu_sass_regions")
    assert script.main([str(_export(tmp_path)), "--launch", "2"]) == 2
    assert "no launch 2 (it holds 2)" in capsys.readouterr().err
    assert script.main([str(tmp_path / "none.csv")]) == 2
