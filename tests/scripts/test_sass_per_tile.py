"""scripts/sass_per_tile.py on hand-made cuobjdump text: functions and their instructions, the longest
round of HMMAs and its instructions a tile, decoder names, clear errors for bad input."""

from __future__ import annotations

from helpers import load_script

TCQ = "_ZN2qp11gemv_kernelINS_8TcqLanesILi4ELi9EEES2_6__halfEEvNS_10GemvParamsE"
HALF = "_ZN2qp11gemv_kernelINS_8TcqLanesILi9ELi11EEENS1_ILi10ELi11EEE13__nv_bfloat16EEvNS_10GemvParamsE"


def _sass(functions: dict[str, list[str]]) -> str:
    out = []
    for name, instructions in functions.items():
        out.append(f"\t\tFunction : {name}")
        for i, ins in enumerate(instructions):
            out.append(f"        /*{16 * i:04x}*/                   {ins} ;            /* 0x000000000000 */")
            out.append(
                "                                                                 /* 0x000fe20000000f00 */"
            )
    return "\n".join(out) + "\n"


def _loop(tiles: int, between: int) -> list[str]:
    """`tiles` HMMAs `between` + 1 instructions apart."""
    out = []
    for _ in range(tiles):
        out += ["IMAD R1, R2, R2, R2"] * between + ["HMMA.16816.F32 R4, R8, R12, R4"]
    return out


def test_first_round_and_instructions_a_tile():
    script = load_script("sass_per_tile")
    body = (
        ["LDG.E.128 R8, desc[UR4][R2.64]"] + _loop(6, 21) + ["@!P0 BRA 0x100"] + ["NOP"] * 2000 + _loop(6, 21)
    )
    text = _sass({TCQ: body, "_ZN2qp15hadamard_kernelEv": ["EXIT"], HALF: ["EXIT"]})
    funcs = script.functions(text)
    assert list(funcs) == [TCQ, "_ZN2qp15hadamard_kernelEv", HALF]
    assert funcs[TCQ][0] == "LDG.E.128 R8, desc[UR4][R2.64]" and funcs["_ZN2qp15hadamard_kernelEv"] == [
        "EXIT"
    ]
    assert script.round_of_tiles(funcs[TCQ], gap=1000) == (6, 22.0)  # the second copy lies 2000 away
    assert script.round_of_tiles(funcs[TCQ], gap=10) is None  # HMMAs 22 apart: no round at this gap
    lines = script.report(text, gap=1000)
    assert len(lines) == 2  # gemv kernels only
    assert (
        lines[0].startswith("TcqLanes<4,9> f16")
        and "6 tiles a round" in lines[0]
        and "22.0 instructions" in lines[0]
    )
    assert lines[1].startswith("TcqLanes<9,11> + TcqLanes<10,11> bf16") and "no main loop" in lines[1]


def test_the_main_loop_not_the_staging_mix():
    """The fused rotation's H_K mix runs a few HMMAs in the staging, ~1000 instructions before the
    main loop: the round is the longer run after it (the first run gave the mix's count)."""
    script = load_script("sass_per_tile")
    body = _loop(10, 8) + ["NOP"] * 1000 + _loop(48, 21) + ["NOP"] * 2000 + _loop(48, 21)
    assert script.round_of_tiles(body, gap=500) == (48, 22.0)
    hmma, per_tile = script.round_of_tiles(body, gap=1500)  # too wide a gap: mix and loop in one run
    assert hmma == 58 and per_tile > 30


def test_predicated_hmma_counts():
    script = load_script("sass_per_tile")
    ins = ["@P1 HMMA.16816.F32 R4, R8, R12, R4", "IADD3 R1, R1, 1, RZ", "@!P2 HMMA.16816.F32 R4, R8, R12, R4"]
    assert script.round_of_tiles(ins, gap=5) == (2, 2.0)


def test_bad_input_is_a_clear_error(tmp_path, capsys, monkeypatch):
    script = load_script("sass_per_tile")
    assert script.main(["--cubin", str(tmp_path / "none.cubin")]) == 2
    assert "no such cubin" in capsys.readouterr().err
    monkeypatch.setattr(script.shutil, "which", lambda tool: None)
    assert script.main([]) == 2
    assert "needs nvcc and cuobjdump" in capsys.readouterr().err
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"")
    assert script.main(["--cubin", str(cubin)]) == 2  # reading a cubin needs cuobjdump only
    assert "needs cuobjdump on PATH" in capsys.readouterr().err
    monkeypatch.setattr(script.shutil, "which", lambda tool: "/usr/bin/" + tool)
    assert script.main(["--sources", str(tmp_path / "missing.cu")]) == 2
    assert "no such source" in capsys.readouterr().err
