"""A decoder-only model run one block at a time from its safetensors files (the sequential pipeline
of llm-compressor): the module tree is built on the meta device and only the embedding, the rotary
tables, the final norm and the one block being run ever hold weights, so a model much larger than
memory can be streamed. Tensors are read through `SourceCheckpoint` (NaN/Inf refused) in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qpalette.calibration.evaluator import block_input, block_output, decoder_blocks
from qpalette.compression.source import SourceCheckpoint
from qpalette.errors import ModelError
from qpalette.models.experts import unfuse_experts


class BlockStream:
    """The model of `model_dir` as a meta skeleton whose pieces are loaded on `device` when needed."""

    def __init__(self, model_dir: Path, device: torch.device):
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(str(model_dir))
            with torch.device("meta"):
                self.model = unfuse_experts(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        except Exception as e:  # noqa: BLE001 — transformers raises many kinds for an unusable config
            first = (str(e).splitlines() or [""])[0][:200]
            raise ModelError(f"cannot build the model of {model_dir}: {first}") from None
        self.device = device
        self.src = SourceCheckpoint(model_dir)
        self.blocks = decoder_blocks(self.model)
        base = self.model.model
        self._load(base.embed_tokens, "model.embed_tokens.")
        self._load(base.norm, "model.norm.")
        # non-persistent buffers (the rotary inverse frequencies) are computed, not stored
        base.rotary_emb = type(base.rotary_emb)(config=self.model.config).to(device)

    def _load(self, module: nn.Module, prefix: str) -> None:
        names = list(module.state_dict())
        missing = [prefix + n for n in names if prefix + n not in self.src.files]
        if missing:
            raise ModelError(f"{self.src.folder}: tensors missing from the checkpoint: {missing[:3]}")
        state = {n: self.src.get(prefix + n).to(self.device, torch.float32) for n in names}
        module.load_state_dict(state, strict=True, assign=True)

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(input of block 0, each block's keyword arguments: mask, rotary tables) for token ids."""
        with torch.no_grad():
            return block_input(self.model, ids.to(self.device))

    def load_block(self, j: int) -> nn.Module:
        """Decoder block j with its weights on the device."""
        block = self.blocks[j]
        self._load(block, f"model.layers.{j}.")
        return block

    def free_block(self, j: int) -> None:
        """Drop block j's weights (back to the meta device)."""
        self.blocks[j].to_empty(device="meta")

    @staticmethod
    def run(block: nn.Module, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
        with torch.no_grad():
            return block_output(block(h, **kwargs))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head's input: the final norm of the last block's output."""
        with torch.no_grad():
            return self.model.model.norm(h)
