"""The decode-step breakdown's kernel kinds."""

import pytest

from qpalette.measure.breakdown import kind_of


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
