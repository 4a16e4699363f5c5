"""transformers integration: `quant_method: "qpalette"` checkpoints load with from_pretrained.

`register()` runs on `import qpalette` (and is idempotent): it adds `QpaletteConfig` and
`QpaletteHfQuantizer` to transformers' quantization registries. Before the weights are read,
the quantizer swaps the planned nn.Linear layers of the meta-device skeleton for qpalette
modules whose buffers match the stored tensors (`checkpoint.convert_model`); after loading it
checks that the checkpoint's codebooks are the ones this qpalette decodes with, and gives the model
a `generate` that does not wait for the GPU after every token (generation/hf_compile.py) and the
packed decode attention (generation/attention.py).
"""

from __future__ import annotations

import warnings

import torch
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from qpalette.errors import CheckpointError
from qpalette.generation.attention import use_packed_attention
from qpalette.generation.hf_compile import deferring_generate
from qpalette.models.topology import (
    CHECKPOINT_TYPE_PREFIX,
    SUPPORTED_MODEL_TYPES,
    base_model_type,
    checkpoint_model_type,
)
from qpalette.runtime.checkpoint import (
    CODEBOOKS_MODULE,
    QUANT_METHOD,
    Layout,
    convert_model,
    dequantize_model,
)
from qpalette.runtime.integrity import verify_shard


class QpaletteConfig(QuantizationConfigMixin):
    """The `quantization_config` of a qpalette checkpoint (written by `qpalette compress`)."""

    def __init__(self, layers: dict | None = None, groups: dict | None = None, sign_seed: int = 0,
                 codebooks: list | None = None, format: str | None = None,
                 qpalette_version: str | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format = format
        self.qpalette_version = qpalette_version
        self.sign_seed = sign_seed
        self.layers = dict(layers or {})
        self.groups = dict(groups or {})
        self.codebooks = list(codebooks or [])
        for k, v in kwargs.items():  # forward-compatible: keep fields we do not use
            setattr(self, k, v)

    def layout(self) -> Layout:
        return Layout.from_config(self.to_dict())


class QpaletteHfQuantizer(HfQuantizer):
    """Loads pre-quantized qpalette checkpoints (quantizing happens in `qpalette compress`)."""

    requires_calibration = True
    quantization_config: QpaletteConfig

    def validate_environment(self, *args, device_map=None, **kwargs):
        if not self.pre_quantized:
            raise ValueError(
                "qpalette quantizes with `qpalette compress MODEL --plan/--scheme -o DIR`, not "
                "inside from_pretrained; load the compressed DIR instead"
            )
        self.on_cuda = _places_on_cuda(device_map)  # update_dtype, called next, needs it

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """float32 on CUDA would run every layer on the slow reference path: the kernels run
        float16 and bfloat16, so load in float16 and say so."""
        if dtype == torch.float32 and getattr(self, "on_cuda", False):
            warnings.warn("qpalette: float32 was asked for on CUDA, where qpalette's kernels run float16 and "
                          "bfloat16 only; loading in float16 (pass dtype=torch.bfloat16 for bfloat16)", stacklevel=2)
            return torch.float16
        return dtype

    def _process_model_before_weight_loading(self, model, **kwargs):
        for f in kwargs.get("checkpoint_files") or []:
            verify_shard(f)
        layout = self.quantization_config.layout()
        convert_model(model, layout, dtype=kwargs.get("dtype") or model.dtype)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        stale = getattr(model, CODEBOOKS_MODULE).mismatches()
        if stale:
            raise CheckpointError(
                f"this checkpoint's codebooks {stale} differ from the ones qpalette "
                f"{self.quantization_config.qpalette_version or '?'} decodes with; load it with "
                "the qpalette version that wrote it"
            )
        deferring_generate(model)  # transformers' generate on CUDA without a GPU wait every token
        use_packed_attention(model)  # decode attention without a copy of the cache per layer
        return model

    def _dequantize(self, model, dtype=None):
        return dequantize_model(model, self.quantization_config.layout(), dtype or torch.float32)

    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (qpalette.runtime.lora); the quantized weights themselves stay frozen

    @property
    def is_compileable(self) -> bool:
        return True


def _places_on_cuda(device_map) -> bool:
    """Whether from_pretrained's `device_map` puts any module on a CUDA device ("auto" and the
    other strategies do when a GPU is present; an int is a GPU index)."""
    if device_map is None:
        return False
    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            return True
        text = str(v)
        if text.startswith("cuda") or (text in ("auto", "balanced", "balanced_low_0", "sequential")
                                       and torch.cuda.is_available()):
            return True
    return False


def register(model_type: str | None = None) -> None:
    """Add qpalette to transformers' registries; a second call (or re-import) is a no-op. The
    checkpoint types of the supported families are registered, and that of another architecture
    transformers knows when its checkpoint type `model_type` is named."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(QpaletteConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(QpaletteHfQuantizer)
    for base in SUPPORTED_MODEL_TYPES:
        _register_checkpoint_type(base, checkpoint_model_type(base))
        _register_checkpoint_type(base, CHECKPOINT_TYPE_PREFIX + base)  # written by earlier versions
    if model_type and model_type.startswith(CHECKPOINT_TYPE_PREFIX):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        base = base_model_type({"model_type": model_type})
        if base in CONFIG_MAPPING:
            _register_checkpoint_type(base, model_type)


def _register_checkpoint_type(base: str, name: str) -> None:
    """`name` (what compress writes as model_type, `qpalette_<base>.needs-import-qpalette`) → the
    base architecture's config and causal-LM classes, subclassed only to carry that name:
    transformers without qpalette refuses the unknown type, printing it, instead of loading the
    checkpoint as `<base>` with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if name in CONFIG_MAPPING:
        return
    base_config = CONFIG_MAPPING[base]
    config_cls = type(f"Qpalette{base_config.__name__}", (base_config,), {"model_type": name})
    model_cls = type(f"Qpalette{MODEL_FOR_CAUSAL_LM_MAPPING[base_config].__name__}",
                     (MODEL_FOR_CAUSAL_LM_MAPPING[base_config],), {"config_class": config_cls})
    AutoConfig.register(name, config_cls)
    AutoModelForCausalLM.register(config_cls, model_cls)


register()  # when this module is what first imports transformers, qpalette's import hook defers to here
