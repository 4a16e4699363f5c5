// tcq kernels, bf16 activations (see qpalette_inst.cuh)
#define QP_T __nv_bfloat16
#define QP_SFX bf16
#define QP_FAMILY_TCQ
#include "qpalette_inst.cuh"
