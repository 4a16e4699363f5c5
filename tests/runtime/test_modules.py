"""qpalette.qlinear: the modules a checkpoint loads into, against the simulated float layer."""

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from qpalette.compression.blocks import quantize_matrix
from qpalette.quant.incoherence import random_signs, unpack_signs, unrotate_weight
from qpalette.runtime import lanes
from qpalette.runtime import modules as qlinear
from qpalette.runtime.modules import FusedSlice, InputRotation, QuantizedLinear, install_cache_reset

ENTRIES = ["nuq-3", "vq-2.5", "tcq-2.0", "half-tcq-3.25"]


def quantized(lin: nn.Linear, quantizer: str, rotation: InputRotation) -> QuantizedLinear:
    out_f, in_f = lin.weight.shape
    q = QuantizedLinear(in_f, out_f, quantizer, bias=lin.bias is not None)
    signs = unpack_signs(rotation.signs)
    for k, v in quantize_matrix(lin.weight.detach(), quantizer, signs, "cpu").items():
        getattr(q, k).copy_(v)
    if lin.bias is not None:
        q.bias.data.copy_(lin.bias.detach())
    q.rotation = rotation
    return q


@pytest.mark.parametrize("name", ENTRIES)
def test_forward_equals_simulated_layer(name, device):
    """The quantized layer computes what the original architecture computes with the
    dequantized, un-rotated weight (the "simulated" model)."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(576, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 576, generator=g) * 0.02)
    rot = InputRotation.from_signs(random_signs(576, 5))
    q = quantized(lin, name, rot).to(device)
    rot.to(device)
    w_sim = unrotate_weight(q.rotated_weight(), unpack_signs(rot.signs))
    x = torch.randn(3, 7, 576, generator=g).to(device)
    expect = x @ w_sim.T + q.bias
    got = q(x)
    rot.reset_cache()
    assert got.shape == (3, 7, 64)
    assert torch.allclose(got, expect, rtol=1e-4, atol=1e-5)
    ref = lin.to(device)(x)  # and close to the float layer (quantization error only)
    assert (got - ref).norm() / ref.norm() < 4 * 2 ** (-q.quantizer.bits)


def test_buffers_match_tensor_specs_and_load_round_trip():
    rot = InputRotation.from_signs(random_signs(128, 1))
    q = quantized(nn.Linear(128, 32, bias=False), "half-tcq-2.25", rot)
    specs = q.quantizer.tensor_specs(32, 128)
    sd = q.state_dict()
    assert set(sd) == set(specs)  # the shared rotation is not a child: stored once, elsewhere
    for k, (shape, dtype) in specs.items():
        assert (tuple(sd[k].shape), sd[k].dtype) == (shape, dtype)
    empty = QuantizedLinear(128, 32, "half-tcq-2.25")
    empty.load_state_dict(sd)
    empty.rotation = rot
    x = torch.randn(2, 128)
    assert torch.equal(empty(x), q(x))
    assert not isinstance(q, nn.Linear)


@pytest.mark.parametrize("name", ["half-tcq-2.75", "half-tcq-3.25", "tcq-3.0"])
def test_a_lane_major_layer_loads_checkpoint_codes_in_its_layout(name):
    """A state dict loaded into a layer whose codes are lane-major already is regrouped as
    `lanes.pack` does (half-tcq-2.75: a second half with its own plane order), and goes out again
    in the checkpoint's layout."""
    rot = InputRotation.from_signs(random_signs(256, 2))
    layer, other = (quantized(nn.Linear(256, 32, bias=False), name, rot) for _ in range(2))
    layer.to_lane_major()
    layer.load_state_dict(other.state_dict())
    packed = lanes.pack(name, other.stored_tensors())
    assert all(torch.equal(layer._buffers[k], packed[k]) for k in lanes.code_names(name))
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in other.state_dict().items())


def test_half_precision_inputs_keep_their_dtype():
    rot = InputRotation.from_signs(random_signs(64, 0))
    q = quantized(nn.Linear(64, 16), "nuq-4", rot)
    for dt in (torch.float16, torch.bfloat16):
        assert q(torch.randn(4, 64).to(dt)).dtype == dt


def test_fused_slices_share_one_matmul_and_the_cache_resets(monkeypatch):
    """Slices of a fused group return their rows of one group call per parent call."""
    g = torch.Generator().manual_seed(3)
    a, b = nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)
    rot = InputRotation.from_signs(random_signs(64, 2))
    group_lin = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        group_lin.weight.copy_(torch.cat([a.weight, b.weight]))
    group = quantized(group_lin, "vq-3.0", rot)
    parent = nn.Module()
    parent.group, parent.rot = group, rot
    parent.a, parent.b = FusedSlice(group, 0, 32), FusedSlice(group, 32, 48)
    calls = []
    real = qlinear.ops.quantized_matmul
    monkeypatch.setitem(qlinear._decoded_bytes, "budget", 0)  # the ops path, not decoded CPU weights
    monkeypatch.setattr(qlinear.ops, "quantized_matmul", lambda *a: calls.append(1) or real(*a))
    parent.forward = lambda x: (parent.a(x), parent.b(x))
    install_cache_reset(parent)
    x = torch.randn(5, 64, generator=g)
    ya, yb = parent(x)
    full = group(x)
    assert len(calls) == 2  # one matmul for both slices, one for the direct call
    assert torch.equal(ya, full[:, :32]) and torch.equal(yb, full[:, 32:])
    x2 = torch.randn(5, 64, generator=g)
    ya2, _ = parent(x2)
    assert not torch.equal(ya2, ya) and group.__dict__["_cache"] is None


def test_cpu_decoded_weights_equal_the_ops_path_and_follow_new_codes(monkeypatch):
    g = torch.Generator().manual_seed(11)
    lin = nn.Linear(64, 48, bias=True)
    rot = InputRotation.from_signs(random_signs(64, 5))
    layer = quantized(lin, "tcq-2.0", rot)
    x = torch.randn(3, 64, generator=g)
    monkeypatch.setitem(qlinear._decoded_bytes, "budget", 0)
    held = qlinear.decoded_bytes()  # other tests' layers may hold some
    y_ops = layer(x)
    assert qlinear.decoded_bytes() == held and "_decoded" not in layer.__dict__
    monkeypatch.setitem(qlinear._decoded_bytes, "budget", held + (1 << 30))
    y_dec = layer(x)
    assert qlinear.decoded_bytes() == held + 64 * 48 * 4
    torch.testing.assert_close(y_dec, y_ops, rtol=1e-4, atol=1e-5)
    other = quantized(nn.Linear(64, 48, bias=True), "tcq-2.0", rot)
    layer.load_state_dict(other.state_dict())  # new codes in place: decoded again
    torch.testing.assert_close(layer(x), other(x), rtol=1e-4, atol=1e-5)
    layer.to(torch.float64)
    assert "_decoded" not in layer.__dict__


def gated_mlp(act: str = "silu", fused: bool = True, bias: bool = False, cls=None):
    """A Llama MLP (64 → 128 → 64; or `cls`, a subclass) quantized as a checkpoint holds it: gate/up
    one group (or two layers) sharing a rotation, down with its own."""
    from transformers import LlamaConfig

    torch.manual_seed(4)
    mlp = (cls or LlamaMLP)(LlamaConfig(hidden_size=64, intermediate_size=128, hidden_act=act, mlp_bias=bias))
    rot_gu, rot_down = InputRotation.from_signs(random_signs(64, 1)), InputRotation.from_signs(random_signs(128, 2))
    if fused:
        both = nn.Linear(64, 256, bias=bias)
        with torch.no_grad():
            both.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            if bias:
                both.bias.copy_(torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]))
        group = quantized(both, "tcq-2.0", rot_gu)
        mlp.gate_up_proj = group
        mlp.gate_proj, mlp.up_proj = FusedSlice(group, 0, 128), FusedSlice(group, 128, 256)
    else:
        mlp.gate_proj, mlp.up_proj = (quantized(lin, "tcq-2.0", rot_gu) for lin in (mlp.gate_proj, mlp.up_proj))
    mlp.down_proj = quantized(mlp.down_proj, "nuq-4", rot_down)
    mlp.rotate_gate_up, mlp.rotate_down = rot_gu, rot_down
    install_cache_reset(mlp)
    return mlp


def test_gated_mlp_hands_the_group_output_to_down(monkeypatch):
    """On the kernels' path (forced here: the ops' CPU reference runs) the MLP calls one gated op
    on the group's output; it computes what the MLP's own forward computes."""
    mlp = gated_mlp()
    assert qlinear.install_gated_mlp(mlp)
    monkeypatch.setitem(qlinear._decoded_bytes, "budget", 0)
    x = torch.randn(3, 64)
    with torch.no_grad():
        own = type(mlp).forward(mlp, x)
        assert torch.equal(mlp(x), own)  # CPU: takes_gated is False, the MLP's own forward runs
        calls = []
        real = qlinear.ops.gated_rotated_matmul
        monkeypatch.setattr(QuantizedLinear, "takes_gated", lambda self, x: True)
        monkeypatch.setattr(qlinear.ops, "gated_rotated_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
        got = mlp(x)
    assert calls == [(3, 256)]
    torch.testing.assert_close(got, own, rtol=1e-4, atol=1e-5)
    clone = copy.deepcopy(mlp)
    assert clone.forward.__self__ is clone
    qlinear.remove_gated_mlp(mlp)
    assert "forward" not in mlp.__dict__


def test_gated_mlp_keeps_its_own_way_for_gradients_and_other_calls(monkeypatch):
    """A group with a trainable bias makes gate/up's output need a gradient even when x does not:
    the gated op (no gradient) is not used then, nor for calls other than mlp(x)."""
    mlp = gated_mlp(bias=True)
    assert qlinear.install_gated_mlp(mlp)
    monkeypatch.setitem(qlinear._decoded_bytes, "budget", 0)
    monkeypatch.setattr(QuantizedLinear, "takes_gated", lambda self, x: True)
    monkeypatch.setattr(qlinear.ops, "gated_rotated_matmul", lambda *a: pytest.fail("gated op called"))
    x = torch.randn(3, 64)
    y = mlp(x)
    y.sum().backward()
    assert mlp.gate_up_proj.bias.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(mlp(x=x), y.detach())


class ClampedMLP(LlamaMLP):
    """Same attributes, other maths (DeepSeek-V4 and others clamp gate and up)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=1)) * self.up_proj(x).clamp(-1, 1))


@pytest.mark.parametrize("act, fused, cls", [("gelu", True, None), ("silu", False, None), ("silu", True, ClampedMLP)])
def test_only_plain_silu_mlps_with_gate_up_fused_are_gated(act, fused, cls):
    assert not qlinear.install_gated_mlp(gated_mlp(act, fused, cls=cls))


@pytest.mark.gpu
def test_gated_mlp_on_the_kernels_equals_its_own_forward(monkeypatch):
    """On CUDA at batch 1 (the rotation fused) the MLP runs the gated GEMV for real; its output
    matches the MLP's own forward (SiLU·mul in torch, then down's GEMV)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    mlp = gated_mlp().to("cuda", torch.float16)
    assert qlinear.install_gated_mlp(mlp)
    calls = []
    real = qlinear.ops.gated_rotated_matmul
    monkeypatch.setattr(qlinear.ops, "gated_rotated_matmul", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        own = type(mlp).forward(mlp, x)
        got = mlp(x)
    assert calls == [1]
    assert ((got.float() - own.float()).norm() / own.float().norm()).item() < 1e-2


# ---- decoder blocks: residual adds and RMSNorms inside the GEMVs ---------------------------------
@pytest.fixture(scope="module")
def tiny_q(tiny_llama_dir, tmp_path_factory):
    from helpers import run_compress

    out = tmp_path_factory.mktemp("q") / "tcq"
    run_compress(tiny_llama_dir, out, scheme="tcq-2.0", random_codes=True)  # its tests check fusion, not codes
    return out


def _count_fused_ops(monkeypatch) -> dict:
    """Calls of the normed and gated ops (with a residual or not) through the modules."""
    calls = {"normed": 0, "normed+residual": 0, "gated": 0, "gated+residual": 0}
    normed, gated = qlinear.ops.normed_rotated_matmul, qlinear.ops.gated_rotated_matmul

    def count(name, op, n_args):  # the residual: the op's last argument (positional or not)
        def call(*a, **k):
            residual = k.get("residual", a[n_args] if len(a) > n_args else None)
            calls[name + ("+residual" if residual is not None else "")] += 1
            return op(*a, **k)
        return call

    monkeypatch.setattr(qlinear.ops, "normed_rotated_matmul", count("normed", normed, 7))
    monkeypatch.setattr(qlinear.ops, "gated_rotated_matmul", count("gated", gated, 5))
    return calls



def test_fused_block_computes_the_layers_own_forward(tiny_q, monkeypatch):
    """Loading installs the fused forward on every decoder layer. On the kernels' path (forced here:
    the ops' CPU reference runs) a block is two normed ops (the second adding the residual) and one
    gated op adding the residual, and the logits equal the layers' own forwards'; with gradients
    enabled the layers run their own way."""
    from qpalette.runtime.loading import load_model

    model, _ = load_model(tiny_q, "cpu", torch.float32, tokenizer=False)
    layers = model.model.layers
    assert all(qlinear.fused_block_parts(b) is not None and "forward" in b.__dict__ for b in layers)
    assert copy.deepcopy(layers[0]).forward.__self__ is not layers[0]
    ids = torch.tensor([[5, 17, 200, 3]])
    with torch.no_grad():
        own = model(ids).logits  # CPU: the fused path does not apply, the layers' own forwards run
    monkeypatch.setattr(QuantizedLinear, "takes_gated", lambda self, x: True)
    monkeypatch.setattr(QuantizedLinear, "takes_normed", lambda self, x, norm: True)
    calls = _count_fused_ops(monkeypatch)
    with torch.no_grad():
        fused = model(ids).logits
    n = len(layers)
    assert calls == {"normed": n, "normed+residual": n, "gated": 0, "gated+residual": n}
    torch.testing.assert_close(fused, own, rtol=1e-4, atol=1e-4)
    model(ids)  # gradients enabled: no fused op
    assert calls["normed"] == n


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_fused_block_takes_llama_style_architectures(model_type, tmp_path, monkeypatch):
    """Mistral's, Qwen2's (q/k/v biases) and Qwen3's (q/k norms) blocks run Llama's layer code with
    attentions that read their input only through q/k/v_proj: they fuse, and compute their own
    forwards' logits (the kernels' path forced: the ops' CPU reference runs). Random code words: what
    is checked is where the block fuses, not the quantizer (head_dim 16: Qwen3's default of 128 made its
    CPU Viterbi take most of this test's time)."""
    from helpers import run_compress
    from tiny_llama import make_tiny_llama

    from qpalette.runtime.loading import load_model

    src = make_tiny_llama(tmp_path / "src", model_type=model_type, head_dim=16)
    run_compress(src, tmp_path / "q", scheme="tcq-2.0", random_codes=True)
    model, _ = load_model(tmp_path / "q", "cpu", torch.float32, tokenizer=False)
    assert qlinear.fused_block_count(model) == len(model.model.layers) == 2
    ids = torch.tensor([[5, 17, 200, 3]])
    with torch.no_grad():
        own = model(ids).logits
        monkeypatch.setattr(QuantizedLinear, "takes_gated", lambda self, x: True)
        monkeypatch.setattr(QuantizedLinear, "takes_normed", lambda self, x, norm: True)
        calls = _count_fused_ops(monkeypatch)
        fused = model(ids).logits
    assert calls["normed+residual"] == calls["gated+residual"] == 2
    torch.testing.assert_close(fused, own, rtol=1e-4, atol=1e-4)


def test_fused_blocks_can_be_turned_off(tiny_q, monkeypatch):
    """QPALETTE_FUSED_BLOCKS=0 at load time keeps every layer's own forward (what `qpalette profile`
    times the unfused constant with)."""
    from qpalette.runtime.loading import load_model

    monkeypatch.setenv("QPALETTE_FUSED_BLOCKS", "0")
    model, _ = load_model(tiny_q, "cpu", torch.float32, tokenizer=False)
    assert qlinear.fused_block_count(model) == 0
    monkeypatch.delenv("QPALETTE_FUSED_BLOCKS")
    model, _ = load_model(tiny_q, "cpu", torch.float32, tokenizer=False)
    assert qlinear.fused_block_count(model) == len(model.model.layers) == 2


def test_blocks_with_other_maths_or_unfused_qkv_keep_their_forward(tiny_q):
    from qpalette.runtime.loading import load_model

    model, _ = load_model(tiny_q, "cpu", torch.float32, tokenizer=False)
    layer = model.model.layers[0]
    qlinear.remove_fused_block(layer)
    assert "forward" not in layer.__dict__
    plain = type(layer)

    class Scaled(plain):
        def forward(self, hidden_states, *args, **kwargs):
            return 2 * super().forward(hidden_states, *args, **kwargs)

    layer.__class__ = Scaled
    assert not qlinear.install_fused_block(layer)
    layer.__class__ = plain
    assert qlinear.install_fused_block(layer)
    qlinear.remove_fused_block(layer)
    layer.self_attn.k_proj = nn.Linear(64, 32)  # q, k, v no longer one group
    assert qlinear.fused_block_parts(layer) is None and not qlinear.install_fused_block(layer)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_block_on_the_kernels_equals_its_own_forward(tiny_llama_dir, tmp_path, monkeypatch, batch):
    """On CUDA (hidden 256, MLP 512: sizes the GEMV rotates and normalises) every block runs the
    normed and gated ops for real: at batch 1 in the GEMVs, at batch 4 in the rotation kernels
    before plain GEMVs; the logits match the layers' own forwards (norms, adds and SiLU·mul in
    torch)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from helpers import run_compress
    from tiny_llama import make_tiny_llama

    from qpalette.models.walk import cache_kwarg
    from qpalette.runtime.loading import load_model

    src = make_tiny_llama(tmp_path / "src", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2)
    run_compress(src, tmp_path / "q", scheme="tcq-2.0")
    model, _ = load_model(tmp_path / "q", "cuda", torch.float16, tokenizer=False)
    ids = torch.tensor([[5, 17, 200]], device="cuda").repeat(batch, 1) + torch.arange(batch, device="cuda")[:, None]
    calls = _count_fused_ops(monkeypatch)
    formed, form = [], qlinear.ops._formed_rotation  # the rotation kernel forming its input (batch > 1)
    monkeypatch.setattr(qlinear.ops, "_formed_rotation", lambda *a: formed.append(form(*a)) or formed[-1])
    cache = cache_kwarg(model)
    with torch.no_grad():
        out = model(ids[:, :1], use_cache=True)
        fused = model(ids[:, 1:2], **{cache: getattr(out, cache)}).logits.float()
        n = len(model.model.layers)
        assert calls["normed+residual"] == 2 * n
        assert len(formed) == (0 if batch == 1 else 3 * 2 * n) and all(f is not None for f in formed)
        for b in model.model.layers:
            qlinear.remove_fused_block(b)
        out = model(ids[:, :1], use_cache=True)
        own = model(ids[:, 1:2], **{cache: getattr(out, cache)}).logits.float()
    assert ((fused - own).norm() / own.norm()).item() < 1e-2
