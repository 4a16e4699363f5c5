"""The lane-major layout: pack/unpack are exact inverses, and the kernels' decoders (emulated on
the host from the CUDA header itself) read it back to the reference decode, bit for bit."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from qpalette.quant.bitpack import unpack_bits
from qpalette.quant.palette import PALETTE, get_quantizer
from qpalette.runtime import lanes, ops
from qpalette.runtime.kernel_build import source_dir

ENTRIES = sorted(PALETTE)


def shape_for(name: str, col_tiles: int) -> tuple[int, int]:
    half = get_quantizer(name).family == "half-tcq"
    return 32, col_tiles * (32 if half else 16)


@pytest.mark.parametrize("name", ENTRIES)
def test_pack_unpack_roundtrip(name):
    rows, cols = shape_for(name, 13)  # 13 tiles: a padded last group
    tensors = get_quantizer(name).random_tensors(rows, cols, torch.Generator().manual_seed(1))
    packed = lanes.pack(name, tensors)
    for k in lanes.code_names(name):  # 13 tiles → 2 groups; W/4 words a lane a group
        rt, _, w = tensors[k].shape
        assert packed[k].shape == (rt, 2, 32 * w // 4) and packed[k].dtype == torch.int32
    assert torch.equal(packed["row_scale"], tensors["row_scale"])
    back = lanes.unpack(name, packed, (rows, cols))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_block_order_is_a_permutation_in_planes():
    for wpg in range(2, 17):
        pos = lanes.block_order(wpg)
        assert sorted(pos.tolist()) == list(range(32 * wpg))
        # the first plane: lane ℓ's words 0..3 are 16 contiguous bytes at 16ℓ
        if wpg >= 4:
            assert pos[5 * wpg : 5 * wpg + 4].tolist() == [20, 21, 22, 23]


def test_the_second_halfs_layout_is_the_firsts_and_one_word():
    """The half-TCQ GEMV loads a group of either half as the first half's planes plus one word at
    32·wpg + ℓ (load_group_either); for an even first half that is the plain layout of wpg + 1."""
    for wpg in range(1, 12):
        first, second = lanes.block_order(wpg).view(32, wpg), lanes.block_order(wpg + 1, True).view(32, wpg + 1)
        assert sorted(second.reshape(-1).tolist()) == list(range(32 * (wpg + 1)))
        assert torch.equal(second[:, :wpg], first)
        assert second[:, wpg].tolist() == [32 * wpg + lane for lane in range(32)]
        assert torch.equal(second, lanes.block_order(wpg + 1).view(32, wpg + 1)) == (wpg % 2 == 0)


def test_padding_tiles_are_zero_and_real_bits_move():
    name = "tcq-2.0"
    t = get_quantizer(name).random_tensors(16, 16 * 9, torch.Generator().manual_seed(2))
    packed = lanes.pack_codes(t["codes"])
    assert packed.shape == (1, 2, 128)
    assert not torch.equal(packed[0, 0], t["codes"][0, :8].reshape(-1))  # a real permutation


def test_kv6_words_put_a_tiles_first_window_in_the_low_half():
    """TCQ KV = 6 lane words are [b2 y b0 b1]: the low 16 bits are the tile's first 16 stream bits
    (its first trellis state), for the 6 tiles that own a word; the other formats keep the stream."""
    assert lanes.kv6_names("tcq-3.0") == ("codes",) and lanes.kv6_names("tcq-2.0") == ()
    assert lanes.kv6_names("half-tcq-3.25") == ("codes_a",) and lanes.kv6_names("half-tcq-2.75") == ("codes_b",)
    codes = get_quantizer("tcq-3.0").random_tensors(16, 16 * 8, torch.Generator().manual_seed(4))["codes"]
    words = lanes.pack_codes(codes, kv6=True)[0, 0]
    bits = unpack_bits(codes[0]).reshape(8, 32, 24)  # tile, lane, the lane's own bits
    for lane in (0, 17, 31):
        for j in range(6):
            word = int(words[lanes.block_order(6)[lane * 6 + j]]) & 0xFFFFFFFF
            first = int("".join(str(int(b)) for b in bits[j, lane, :16]), 2)
            assert word & 0xFFFF == first, (lane, j)
    assert torch.equal(lanes.unpack_codes(lanes.pack_codes(codes, kv6=True), 8, 24, kv6=True), codes)
    assert not torch.equal(lanes.pack_codes(codes, kv6=True), lanes.pack_codes(codes))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the decoder emulator")
    exe = tmp_path_factory.mktemp("emu") / "lanes_emulator"
    src = Path(__file__).with_name("lanes_emulator.cpp")
    subprocess.run([cxx, "-O1", "-std=c++17", "-I", str(source_dir()), "-o", str(exe), str(src)], check=True)
    return exe


@pytest.mark.parametrize("name", ENTRIES)
def test_kernel_decoders_read_the_layout_back(name, emulator, tmp_path):
    rows, cols = shape_for(name, 11)
    q = get_quantizer(name)
    tensors = q.random_tensors(rows, cols, torch.Generator().manual_seed(3), row_scale=torch.ones(rows))
    packed = lanes.pack(name, tensors)
    spec = ops.kernel_spec(name)
    table = ops.table_entries(spec).to(torch.float16).contiguous().view(torch.int32).reshape(-1)
    table.numpy().tofile(tmp_path / "lut.bin")
    names = lanes.code_names(name)
    for n, file in zip(names, ("codes_a.bin", "codes_b.bin")):
        packed[n].contiguous().numpy().tofile(tmp_path / file)
    subprocess.run([str(emulator), spec.family, str(spec.p0), str(spec.p1), str(rows), str(cols), str(tmp_path)],
                   check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "values.bin", dtype=np.float16).reshape(rows, cols))
    want = ops.dequantize(name, tensors, (rows, cols)).half()
    assert torch.equal(got.float(), want.float())
