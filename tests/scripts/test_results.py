"""scripts/make_results.py on the repository's measured results (run as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_results_regenerates_report_from_results(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_results.py"), "--results", str(ROOT / "results"),
                    "--out", str(out)], check=True)
    text = out.read_text()
    for png in ("quality_smollm2", "linearity_smollm2", "kernels_h100", "decode_llama8b"):
        assert (tmp_path / "results" / f"{png}.png").stat().st_size > 1000
        assert f"results/{png}.png" in text
    fp16 = json.loads((ROOT / "results/speed_llama8b_v2/bench_fp16.json").read_text())["rows"][0]
    assert f"| fp16 | – | 1 | {fp16['loop_tok_per_s']:.1f} | 1.00× | {fp16['tok_per_s']:.1f} |" in text
    targets = text[text.index("## Targets"):]
    assert targets.count("| speed plan ") == len(list((ROOT / "results/speed_llama8b_v2").glob("plan_speed*.json")))
    assert "host time of one graph call" in text
