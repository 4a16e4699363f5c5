"""Running compressed models: a new kernel goes in cuda/ and is dispatched from ops.

ops           the torch.library ops (rotate, quantized_matmul): reference on CPU, kernels on CUDA
lanes         the lane-major code layout the kernels read, regrouped from the checkpoint's at load
kernel_build  building and loading the CUDA extension from cuda/
modules       InputRotation, QuantizedLinear, FusedSlice, Codebooks
checkpoint    the checkpoint format (quantization_config, Layout) and model conversion
hf_quantizer  the transformers integration (quant_method "qpalette")
loading       the one model loader (original or compressed)
"""
