// half_tcq kernels, f16 activations (see qpalette_inst.cuh)
#define QP_T __half
#define QP_SFX f16
#define QP_FAMILY_HALF_TCQ
#include "qpalette_inst.cuh"
