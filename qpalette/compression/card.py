"""The model card (README.md) of a compressed checkpoint."""

from __future__ import annotations

from pathlib import Path

from qpalette.models.sources import hub_id
from qpalette.runtime.checkpoint import Layout
from qpalette.version import __version__


def model_card(layout: Layout, source: str, report: dict, model_type: str) -> str:
    counts: dict[str, int] = {}
    for q in layout.layers.values():
        counts[q] = counts.get(q, 0) + 1
    mix = ", ".join(f"{q} ×{n}" for q, n in sorted(counts.items()))
    by = report["bytes"]
    base = hub_id(source)
    base_lines = f"base_model: {base}\nbase_model_relation: quantized\n" if base else ""
    return f"""---
{base_lines}library_name: transformers
tags: [qpalette, quantized]
---
# {Path(source).name} — qpalette compressed

**This checkpoint needs `import qpalette` before loading.** Its `model_type` is
`{model_type}`: without qpalette, transformers refuses it ("does not recognize this
architecture"); `import qpalette` registers the type and the quantization format.

```python
import qpalette  # registers the qpalette quantizer with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
# or: model = qpalette.from_pretrained("path/to/this/folder")  (picks device and dtype)
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```

- Source: `{source}`
- Quantized linear layers: {len(layout.layers)} ({mix}); fused groups: {len(layout.groups)}
- Average bits (quantized layers, nominal): {report['avg_bits']:.3f}
- Tensor bytes: {by['total']:,} (codes + row scales {by['codes_and_row_scales']:,}, sign vectors
  {by['sign_vectors']:,}, codebooks {by['codebooks']:,}, unquantized modules {by['unquantized_modules']:,})
- Written by qpalette {__version__}; format `qpalette.checkpoint/1`.
{_data_aware_line(report.get("data_aware"))}
{"- **Random code words (`--random-codes`): for speed measurements only, the outputs are noise.**" if report.get("random_codes") else ""}
"""


def _data_aware_line(data_aware: dict | None) -> str:
    if not data_aware:
        return "- Rounding: nearest code (data-free)"
    h = data_aware["hessians"]
    return (f"- Rounding: data-aware LDLQ, Hessians of {h['tokens']:,} tokens of {h['source']}, "
            f"damping {data_aware['damp']} × mean diag(H)")
