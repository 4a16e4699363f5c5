"""The one model loader: an original or a compressed checkpoint, on a device, ready to run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qpalette.errors import CheckpointError, ModelError
from qpalette.generation.attention import use_packed_attention
from qpalette.models.experts import unfuse_experts
from qpalette.progress import quiet_library_bars
from qpalette.runtime.checkpoint import QUANT_METHOD
from qpalette.runtime.integrity import verify_checkpoint_files


def default_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA (what the kernels and the FP16 baseline run in), float32 on CPU."""
    return torch.float16 if device.type == "cuda" else torch.float32


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               *, tokenizer: bool = True, device_map: dict[str, str] | None = None):
    """(model in eval mode on `device`, tokenizer or None) from a local model directory, original or
    qpalette-compressed. A compressed model on CUDA runs one token first, so the codes are in the
    kernels' layout and their tables exist before anything is compiled or captured. `device_map`
    (module name → device, covering the model) splits the model over several devices instead:
    each module is loaded straight onto its device and accelerate's hooks move the activations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpalette.runtime.hf_quantizer import register

    register(_model_type(path))
    quiet_library_bars()
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if _is_qpalette_folder(path):
        verify_checkpoint_files(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                     **({"device_map": device_map} if device_map else {}))
    except (CheckpointError, ModelError):
        raise
    except Exception as e:  # noqa: BLE001 — transformers raises many kinds for an unusable folder
        raise ModelError(f"cannot load a causal LM from {path}: {str(e).splitlines()[0][:200]}") from None
    model = unfuse_experts(model)  # MoE experts as one layer each (a no-op if quantized)
    model = (model if device_map else model.to(device)).eval()
    use_packed_attention(model)  # decode attention without a copy of the cache per layer (generation/attention.py)
    if is_quantized(model) and device.type == "cuda":
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=device))
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except Exception:  # noqa: BLE001 — a model without a tokenizer still runs on token ids
            tok = None
    return model, tok


def _is_qpalette_folder(path) -> bool:
    """A local folder whose config.json declares a qpalette checkpoint (a broken config.json is
    left to from_pretrained, which names what is wrong with it)."""
    cfg = Path(path) / "config.json"
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _model_type(path) -> str | None:
    """The model_type of a local folder's config.json, if it can be read."""
    try:
        mt = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return mt if isinstance(mt, str) else None


def is_quantized(model) -> bool:
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return method == QUANT_METHOD


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None):
    """A qpalette checkpoint on `device` (default: CUDA when present) in `dtype` (default: float16
    on CUDA, float32 on CPU); refuses a folder that is not one."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, _ = load_model(path, device, dtype, tokenizer=False)
    if not is_quantized(model):
        raise CheckpointError(f"{path} is not a qpalette checkpoint (no quant_method 'qpalette')")
    return model
