"""A tiny random Llama (+ byte-level tokenizer) saved as a Hugging Face folder, for fast tests."""

from __future__ import annotations

from pathlib import Path

from qpalette.models.synthetic import byte_tokenizer


def make_tiny_llama(path, seed: int = 0, model_type: str = "llama", **overrides) -> Path:
    """2 blocks, hidden 64, MLP 128, 4 heads (2 kv), vocab 257 (256 bytes + <s>). Returns path.

    `model_type` llama, mistral, qwen2 (q/k/v biases) or qwen3 (q/k norms) picks the class."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    tok = byte_tokenizer()
    n = len(tok)  # 256 bytes + <s>, which is BOS and EOS
    cfg = dict(vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=n - 1, eos_token_id=n - 1, tie_word_embeddings=False,
               initializer_range=0.1)
    cfg.update(overrides)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config)
    if model_type == "qwen2":  # biases start at zero: make them matter
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      initializer_range=0.02, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def train_tiny_llama(path, text_file, steps: int = 60, windows: int = 4, seq_len: int = 128) -> Path:
    """make_tiny_llama, then Adam on the first `windows` windows of `text_file` (the windows the
    calibration tests measure on). Returns path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpalette.calibration.data import text_windows

    path = make_tiny_llama(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = text_windows(tok, Path(text_file).read_text(encoding="utf-8", errors="replace"), windows, seq_len)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    model.save_pretrained(path)
    return path
