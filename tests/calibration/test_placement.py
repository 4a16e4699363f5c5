"""Calibrate on several devices: where the model goes (a whole copy per device, or split over them),
and the block evaluator on a model dispatched by accelerate."""

from __future__ import annotations

import pytest
import torch

from qpalette.calibration.evaluator import BlockEvaluator, linear_layers, module_device
from qpalette.calibration.noise import Settings, layer_deltas
from qpalette.calibration.placement import Split, Unit, model_units, place
from qpalette.calibration.sensitivity import CalibrateOptions, calibrate
from qpalette.devices import parse_memory
from qpalette.errors import CalibrationError, InputError
from qpalette.runtime.loading import load_model

GiB = 2**30


def _units(*sizes_gib: float) -> list[Unit]:
    """[embedding, blocks..., head] of the given sizes."""
    names = ["embed", *(f"layers.{j}" for j in range(len(sizes_gib) - 2)), "head"]
    return [Unit((n,), int(s * GiB)) for n, s in zip(names, sizes_gib)]


def test_a_model_that_fits_every_device_gets_a_copy_on_each():
    units = _units(1, 4, 4, 1)  # 10 GiB
    assert place(units, [10 * GiB, 10 * GiB], ["cuda:0", "cuda:1"]) is None
    assert place(units, [None, None], ["cpu", "cpu"]) is None  # a CPU without --max-memory: no limit
    assert place(units, [10 * GiB], ["cuda:0"]) is None


def test_a_model_too_large_for_one_device_is_split_in_block_order():
    units = _units(1, 4, 4, 4, 4, 1)  # 18 GiB
    split = place(units, [10 * GiB, 10 * GiB], ["cuda:0", "cuda:1"])
    assert isinstance(split, Split) and split.where == [0, 0, 0, 1, 1, 1]
    assert split.device_map(["cuda:0", "cuda:1"]) == {
        "embed": "cuda:0", "layers.0": "cuda:0", "layers.1": "cuda:0",
        "layers.2": "cuda:1", "layers.3": "cuda:1", "head": "cuda:1"}
    # one device too small for a copy is enough to split; the blocks fill the devices in order
    split = place(_units(1, 4, 4, 1), [20 * GiB, 6 * GiB, 20 * GiB], ["cuda:0", "cuda:1", "cuda:2"])
    assert split.where == [0, 0, 0, 0]
    # a block is never cut: a device that cannot take the next one is left for the following one
    split = place(_units(1, 4, 4, 1), [6 * GiB, 3 * GiB, 6 * GiB], ["cuda:0", "cuda:1", "cuda:2"])
    assert split.where == [0, 0, 2, 2]


def test_a_model_that_fits_nowhere_is_a_clear_error():
    with pytest.raises(CalibrationError, match=r"do not fit on cuda:0 \(room for 8.00 GiB.*--device cuda:0,cuda:1"):
        place(_units(1, 4, 4, 1), [8 * GiB], ["cuda:0"])
    with pytest.raises(CalibrationError, match=r"do not fit even split over 2 devices.*cuda:0 5.00 GiB, cuda:1 5.00 GiB"):
        place(_units(1, 4, 4, 4, 1), [5 * GiB, 5 * GiB], ["cuda:0", "cuda:1"])
    with pytest.raises(CalibrationError, match="largest block 6.00 GiB"):
        place(_units(1, 6, 1), [5 * GiB, 5 * GiB], ["cuda:0", "cuda:1"])


def test_parse_memory():
    assert parse_memory("20GiB") == 20 * GiB and parse_memory("80GB") == 80 * 10**9
    assert parse_memory(" 1.5 MiB") == 3 * 2**19 and parse_memory("1000b") == 1000
    for bad in ("20", "GiB", "-1GiB", "0GB", "20XB"):
        with pytest.raises(InputError, match="bad --max-memory"):
            parse_memory(bad)


def test_model_units_count_the_weights_in_the_run_dtype(tiny_llama_dir):
    units = model_units(tiny_llama_dir, torch.float32)
    assert [u.names for u in units] == [("model.embed_tokens", "model.rotary_emb"), ("model.layers.0",),
                                        ("model.layers.1",), ("model.norm", "lm_head")]
    model, _ = load_model(tiny_llama_dir, "cpu", torch.float32, tokenizer=False)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers())
    assert sum(u.nbytes for u in units) == 4 * (params + buffers)
    half = model_units(tiny_llama_dir, torch.bfloat16)
    assert [u.nbytes for u in half] == [u.nbytes // 2 for u in units]


def test_model_units_keep_a_tied_head_with_the_embedding(tmp_path):
    from tiny_llama import make_tiny_llama

    units = model_units(make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True), torch.float32)
    assert units[0].names == ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head")
    assert [u.names for u in units[1:]] == [("model.layers.0",), ("model.layers.1",)]


def test_evaluator_on_a_model_dispatched_per_module(tiny_llama_dir):
    """A model dispatched by accelerate with a device map naming every block (all on the CPU here;
    cuda:0/cuda:1 on a GPU machine): the evaluator reads each block's device from its hook, keeps
    the hooks working, and measures what it measures on the plain model."""
    from accelerate import dispatch_model

    tokens = torch.randint(0, 257, (3, 16), generator=torch.Generator().manual_seed(0))
    plain, _ = load_model(tiny_llama_dir, "cpu", torch.float32, tokenizer=False)
    model, _ = load_model(tiny_llama_dir, "cpu", torch.float32, tokenizer=False)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map, force_hooks=True)
    blocks = model.model.layers
    hooked = [b.forward for b in blocks]
    assert all(hasattr(b, "_hf_hook") for b in blocks) and module_device(blocks[1]) == torch.device("cpu")
    ev = BlockEvaluator(model, tokens, 2, "cpu", 1 << 30)
    ev.prepare()
    assert [b.forward for b in blocks] == hooked  # block_input put accelerate's wrappers back
    assert ev.block_devices == [torch.device("cpu")] * 2
    st = Settings(seed=0, levels=3, t_max=1.0, batch_size=2, dtype="float32")
    names = [n for n, _m, _b in linear_layers(plain)]
    want = list(layer_deltas(plain, tokens, names, st, "cpu"))
    got = list(layer_deltas(model, tokens, names, st, "cpu"))
    assert [(n, d) for n, d, _s in got] == [(n, d) for n, d, _s in want]


def _opts(model_dir, out, **kw):
    base = dict(model=str(model_dir), output=out, num_seqs=4, seq_len=32, levels=4, seed=0,
                devices=["cpu"], batch_size=2, progress=False)
    base.update(kw)
    return CalibrateOptions(**base)


def test_too_little_memory_is_refused_before_loading(tiny_llama_dir, tmp_path, monkeypatch):
    import qpalette.runtime.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(CalibrationError, match="do not fit on cpu"):
        calibrate(_opts(tiny_llama_dir, tmp_path / "s.json", max_memory=300_000), log=lambda m: None)
    with pytest.raises(CalibrationError, match="do not fit even split over 2 devices"):
        calibrate(_opts(tiny_llama_dir, tmp_path / "s.json", devices=["cpu", "cpu"], max_memory=100_000),
                  log=lambda m: None)
    assert not list(tmp_path.iterdir())


def _no_context_here(monkeypatch):
    """A process without a CUDA context, where asking cudaMemGetInfo itself fails the test."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: pytest.fail("this process opened a CUDA context"))


def test_several_gpus_are_measured_by_a_child_process(monkeypatch):
    """The spawning process must not hold a CUDA context on every GPU: free memory of several GPUs
    comes from a short-lived child."""
    import subprocess

    import qpalette.calibration.placement as placement

    _no_context_here(monkeypatch)
    asked = []

    def child(cmd, **kw):
        asked.append(cmd[3:])
        return subprocess.CompletedProcess(cmd, 0, stdout=f"[{8 * GiB}, {4 * GiB}]\n", stderr="")

    monkeypatch.setattr(placement.subprocess, "run", child)
    gpus = [torch.device("cuda:0"), torch.device("cuda:1")]
    assert placement.device_budgets(gpus, None) == [6 * GiB, 3 * GiB]  # WEIGHT_FRACTION of free
    assert placement.device_budgets(gpus, 5 * GiB) == [5 * GiB, 3 * GiB]
    assert asked == [["0", "1"], ["0", "1"]]


def test_a_child_that_cannot_answer_falls_back_to_this_process(monkeypatch):
    import subprocess

    import qpalette.calibration.placement as placement

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (2 * GiB, 80 * GiB))
    monkeypatch.setattr(placement.subprocess, "run",
                        lambda cmd, **kw: (_ for _ in ()).throw(subprocess.CalledProcessError(1, cmd)))
    assert placement.device_budgets([torch.device("cuda:0"), torch.device("cuda:1")], None) == [
        int(1.5 * GiB), int(1.5 * GiB)]
