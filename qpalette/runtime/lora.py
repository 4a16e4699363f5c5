"""LoRA adapters on a compressed model, through peft: the quantized layers stay frozen, the
adapters train, gradients reach every layer's input through the quantized matmul's backward
(runtime/ops.py: the dequantize kernel on CUDA, the reference elsewhere).

    from peft import get_peft_model
    from qpalette.runtime.lora import lora_config, load_adapter
    model = get_peft_model(qpalette.from_pretrained(DIR), lora_config(r=16, target_modules=[...]))
    ... train ...; model.save_pretrained(ADAPTER_DIR)
    model = load_adapter(qpalette.from_pretrained(DIR), ADAPTER_DIR)

peft does not know qpalette's layers, and its way to add a layer type (`LoraConfig.
_register_custom_module`) is per config and not saved with the adapter: `lora_config` and
`load_adapter` do that registration. Merging adapters into the quantized weights is refused:
the codes cannot absorb a dense update without requantizing.
"""

from __future__ import annotations

import torch
from torch import nn

from qpalette.errors import InputError, QpaletteError
from qpalette.runtime.modules import FusedSlice, QuantizedLinear

PEFT_MIN = (0, 21)


def _peft():
    try:
        import peft
    except ImportError:
        raise InputError("LoRA needs peft: pip install 'qpalette[lora]' (peft ≥ 0.21)") from None
    if tuple(int(p) for p in peft.__version__.split(".")[:2]) < PEFT_MIN:
        raise InputError(f"LoRA needs peft ≥ {'.'.join(map(str, PEFT_MIN))}, found {peft.__version__}")
    return peft


def _layer_class():
    """The LoRA layer class, built on first use so that importing qpalette never imports peft."""
    from peft.tuners.lora.layer import LoraLayer

    class QpaletteLoraLinear(nn.Module, LoraLayer):
        """base(x) + Σ_adapters B·A·dropout(x)·scaling over a frozen qpalette layer."""

        def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                     **kwargs):
            if config.lora_bias or config.use_dora:
                raise InputError("qpalette LoRA layers support plain LoRA (no lora_bias, no DoRA)")
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters:
                return result
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                a, b = self.lora_A[name], self.lora_B[name]
                delta = b(a(self.lora_dropout[name](x.to(a.weight.dtype)))) * self.scaling[name]
                result = result + delta.to(result.dtype)
            return result

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise QpaletteError("merging LoRA adapters into qpalette's quantized weights is not supported: keep "
                                "the adapter separate (or merge into the original model and compress again)")

        def unmerge(self) -> None:
            pass  # nothing is ever merged

        def __repr__(self) -> str:
            return "qpalette." + super().__repr__()

    return QpaletteLoraLinear


def register_layers(config) -> None:
    """Teach one peft LoraConfig qpalette's layer types."""
    cls = _layer_class()
    config._register_custom_module({QuantizedLinear: cls, FusedSlice: cls})


def lora_config(**kwargs):
    """A peft LoraConfig (its keyword arguments) that knows qpalette's layers."""
    config = _peft().LoraConfig(**kwargs)
    register_layers(config)
    return config


def load_adapter(model, adapter_dir, is_trainable: bool = False):
    """A peft model: `model` (a loaded qpalette model) with the adapter saved in `adapter_dir`."""
    peft = _peft()
    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    register_layers(config)
    return peft.PeftModel.from_pretrained(model, str(adapter_dir), config=config, is_trainable=is_trainable)
