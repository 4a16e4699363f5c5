"""The model being compressed, read tensor by tensor from its safetensors files (never all at once);
every floating tensor is checked for NaN/Inf as it is read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qpalette.errors import CompressError
from qpalette.fileio import read_json_object
from qpalette.models.experts import module_name


class SourceCheckpoint:
    """Tensor name → safetensors file of a Hugging Face model folder (single or sharded). Names are
    the module tree's (`files`): a Mixtral checkpoint's per-expert tensors are read under the names
    of the split experts (models/experts.py)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            data = read_json_object(index, "safetensors index", CompressError)
            stored_files = {k: folder / v for k, v in data.get("weight_map", {}).items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                if any(folder.glob("*.bin")):
                    raise CompressError(
                        f"{folder} holds only PyTorch .bin (pickle) weights; qpalette reads "
                        "safetensors only: convert with `model.save_pretrained(dir)` first"
                    )
                raise CompressError(f"{folder} has no .safetensors weights")
            stored_files = {k: f for f in files for k in self._open(f).keys()}
        self.stored = {module_name(k): k for k in stored_files}
        self.files = {name: stored_files[k] for name, k in self.stored.items()}
        self._handles: dict[Path, object] = {}

    def _open(self, f: Path):
        try:
            return safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CompressError(f"cannot read {f}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = self._open(f)
        try:
            t = self._handles[f].get_tensor(self.stored[name])
        except (SafetensorError, OSError) as e:
            raise CompressError(f"cannot read tensor {name} from {f}: {e}") from None
        check_finite(t, f"{name} in {f.name}")
        return t

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in sorted(set(self.files.values())):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
        return h.hexdigest()[:16]


def check_finite(t: torch.Tensor, what: str) -> None:
    """Refuse a floating tensor holding NaN/Inf, naming it."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CompressError(f"{what} holds {bad:,} NaN/Inf value(s): the source model is damaged; "
                            "nothing of it can be quantized faithfully")


class StateDictSource:
    """The SourceCheckpoint interface (`files`, `get`) over a loaded model's tensors, for
    quantizing in memory with the same per-block code as compress."""

    folder = "the loaded model"  # what error messages name

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.files = dict.fromkeys(state)

    def get(self, name: str) -> torch.Tensor:
        t = self.state[name].detach().cpu()
        check_finite(t, name)
        return t


def half_dtype(cfg: dict) -> torch.dtype:
    """16-bit dtype of everything left unquantized: the source's bf16, else fp16."""
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "")
    return torch.bfloat16 if "bfloat16" in name else torch.float16
