"""The decode-step breakdown's kernel kinds."""

import pytest

from qpalette.measure.breakdown import aggregate, kind_of, matmul_positions


@pytest.mark.parametrize("name, kind", [
    ("void qp::qmm_kernel<qp::TcqDec<4, 9>, qp::TcqDec<4, 9>, __half>(qp::QmmKParams)", "qpalette matmul"),
    ("void qp::gemv_kernel<qp::TcqLanes<4, 9>, qp::TcqLanes<4, 9>, __half>(qp::GemvParams)", "qpalette matmul"),
    ("void qp::dequant_kernel<qp::PairLanes<8>, qp::PairLanes<8>, __nv_bfloat16>(qp::DequantParams)",
     "qpalette dequantize"),
    ("void qp::(anonymous namespace)::hadamard_kernel<__half>(__half const*, __half*, unsigned c", "online Hadamard"),
    ("void qp::(anonymous namespace)::hadamard_rows_kernel<__half>(__half const*, __half*, unsigned c",
     "online Hadamard"),
    ("nvjet_sm90_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", "cuBLAS GEMM/GEMV"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3", "attention"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_15", "inductor fused (triton)"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
])
def test_breakdown_kinds(name, kind):
    assert kind_of(name).startswith(kind)


def test_aggregate_counts_time_and_launches_per_step():
    """Two steps of a toy model: a GEMV a layer (2 layers), one cache add a layer, one argmax."""
    gemv, add, arg = "void qp::gemv_kernel<qp::TcqLanes<4, 9>>(qp::GemvParams)", "triton_poi_fused_add_copy__8", "triton_argmax"
    step = [(gemv, 10.0), (add, 1.0), (gemv, 12.0), (add, 1.0), (arg, 3.0)]
    res = aggregate(step * 2, steps=2)
    assert res["kinds_s"] == {"qpalette matmul": pytest.approx(22e-6), "inductor fused (triton)": pytest.approx(5e-6)}
    assert res["kernels_per_step"] == {"qpalette matmul": 2, "inductor fused (triton)": 3}
    assert res["kernel_sum_s"] == pytest.approx(27e-6)
    assert list(res["top_kernels_s"]) == [gemv, arg, add]  # costliest first
    assert res["top_kernel_launches_per_step"] == {gemv: 2, arg: 1, add: 2}


def test_matmul_positions_average_each_projection_over_layers_and_steps():
    """Two steps of 3 blocks × 2 matmuls + a head: position j of every block, averaged, and the head."""
    step1 = [1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 100.0]
    step2 = [3.0, 30.0, 2.0, 20.0, 1.0, 10.0, 50.0]
    res = matmul_positions(step1 + step2, steps=2, layers=3)
    assert res["per_block"] == pytest.approx([2.0, 20.0])
    assert res["after_blocks"] == pytest.approx([75.0])
    assert matmul_positions([5.0], steps=1, layers=3) == {"per_block": [], "after_blocks": []}
