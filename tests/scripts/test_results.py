"""scripts/make_results.py on the repository's measured results, and decode_breakdown's kernel kinds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_results_regenerates_report_from_results(tmp_path, monkeypatch):
    mr = load_script("make_results")
    out = tmp_path / "results.md"
    monkeypatch.setattr("sys.argv", ["make_results", "--results", str(ROOT / "results"), "--out", str(out)])
    mr.main()
    text = out.read_text()
    for png in ("quality_smollm2", "linearity_smollm2", "kernels_h100", "decode_llama8b"):
        assert (tmp_path / "results" / f"{png}.png").stat().st_size > 1000
        assert f"results/{png}.png" in text
    fp16 = json.loads((ROOT / "results/speed_llama8b/bench_fp16.json").read_text())["rows"][0]
    assert f"| fp16 | – | 1 | {fp16['loop_tok_per_s']:.1f} | 1.00× | {fp16['tok_per_s']:.1f} |" in text
    targets = text[text.index("## Targets"):]
    assert targets.count("| speed plan ") == len(list((ROOT / "results/speed_llama8b").glob("plan_speed*.json")))
    assert "host time of one graph call" in text


@pytest.mark.parametrize("name, kind", [
    ("void qp::qmm_kernel<qp::TcqDec<4, 9>, qp::TcqDec<4, 9>, __half>(qp::QmmKParams)", "qpalette matmul"),
    ("void qp::(anonymous namespace)::hadamard_kernel<__half>(__half const*, __half*, unsigned c", "online Hadamard"),
    ("nvjet_sm90_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", "cuBLAS GEMM/GEMV"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3", "attention"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_15", "inductor fused (triton)"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
])
def test_breakdown_kinds(name, kind):
    assert load_script("decode_breakdown").kind_of(name).startswith(kind)
