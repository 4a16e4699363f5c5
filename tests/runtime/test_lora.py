"""LoRA adapters through peft on a compressed model: gradients through the quantized layers,
training, saving and loading, merging refused."""

import pytest
import torch
from helpers import run_compress

import qpalette
from qpalette.errors import QpaletteError
from qpalette.quant.incoherence import pack_signs, random_signs, rotate_input, unpack_signs
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes, modules, ops

peft = pytest.importorskip("peft")
from qpalette.runtime.lora import load_adapter, lora_config  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("entry,n", [("nuq-4", 96), ("vq-4.0", 128), ("tcq-2.0", 160), ("half-tcq-3.25", 96)])
def test_input_gradient_equals_the_dense_layers(entry, n, device):
    """dL/dx through rotate + quantized_matmul (and the fused op) equals the gradient through the
    same layer written densely; on CUDA the dequantize kernel serves the backward."""
    g = torch.Generator(device=device).manual_seed(n)
    t = lanes.pack(entry, get_quantizer(entry).random_tensors(32, n, g, device))
    codes, codes_b = ops.code_tensors(entry, t)
    signs = pack_signs(random_signs(n, seed=3)).to(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    w = ops._dense_weight_reference(codes, codes_b, t["row_scale"], entry, 32, n, torch.float32)
    x = torch.randn(5, n, device=device, dtype=dtype)
    gy = torch.randn(5, 32, device=device, dtype=dtype)
    ref = x.float().clone().requires_grad_()
    ((rotate_input(ref, unpack_signs(signs)) @ w.T) * gy.float()).sum().backward()
    for call in (lambda v: ops.quantized_matmul(ops.rotate(v, signs), entry, t, (32, n)),
                 lambda v: ops.rotated_matmul(v, signs, entry, t, (32, n))):
        mine = x.detach().clone().requires_grad_()
        (call(mine) * gy).sum().backward()
        tol = 2e-2 if dtype == torch.float16 else 1e-4
        torch.testing.assert_close(mine.grad.float(), ref.grad, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def tiny_q(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "q"
    run_compress(tiny_llama_dir, out, scheme="nuq-4")
    return out


@pytest.mark.parametrize("decoded", [True, False], ids=["decoded-weights", "reference-ops"])
def test_a_few_steps_lower_the_loss_and_the_codes_stay(tiny_q, decoded, monkeypatch, tmp_path):
    monkeypatch.setitem(modules._decoded_bytes, "budget", None if decoded else 0)
    model = qpalette.from_pretrained(tiny_q, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, modules.QuantizedLinear)]
    before = [{k: v.clone() for k, v in m.checkpoint_tensors().items()} for m in layers]
    pm = peft.get_peft_model(model, lora_config(r=4, lora_alpha=8, target_modules=TARGETS))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(12):
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    for m, saved in zip(layers, before):  # frozen (in the checkpoint's layout: the ops may regroup them)
        assert all(torch.equal(v, saved[k]) for k, v in m.checkpoint_tensors().items())
    pm.save_pretrained(tmp_path / "adapter")
    again = load_adapter(qpalette.from_pretrained(tiny_q, device="cpu"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, pm(input_ids=ids).logits)
    with pytest.raises(QpaletteError, match="not supported"):
        pm.merge_and_unload()


def test_the_hf_quantizer_says_trainable(tiny_q):
    model = qpalette.from_pretrained(tiny_q, device="cpu")
    assert model.hf_quantizer.is_trainable


@pytest.mark.gpu
def test_lora_on_smollm2_on_the_gpu(smollm2_dir, tmp_path, monkeypatch):
    """SmolLM2-135M compressed (tcq-3.0), LoRA on every projection, on the CUDA kernels: the
    adapters' gradients equal the reference path's (QPALETTE_KERNELS=0, same GPU), and 20 AdamW
    steps on one batch lower the loss."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from transformers import AutoTokenizer

    out = tmp_path / "q"
    qpalette.compress(str(smollm2_dir), "tcq-3.0", out, device="cuda", quiet=True)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = ["The quick brown fox jumps over the lazy dog. " * 8, "Quantized weights stay frozen while adapters learn. " * 8]
    ids = tok(text, return_tensors="pt", truncation=True, max_length=64).input_ids.cuda()
    pm = peft.get_peft_model(qpalette.from_pretrained(out, device="cuda"),
                             lora_config(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    with torch.no_grad():  # a non-zero B, so that every adapter's A gets a gradient
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1e-3)

    def grads() -> list[torch.Tensor]:
        pm.zero_grad()
        pm(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.float().clone() for p in trainable]

    on_kernels = grads()
    monkeypatch.setenv("QPALETTE_KERNELS", "0")
    on_reference = grads()
    monkeypatch.delenv("QPALETTE_KERNELS")
    for k, r in zip(on_kernels, on_reference):
        assert ((k - r).norm() / r.norm().clamp_min(1e-12)) < 5e-2
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
