#!/usr/bin/env python3
"""Diagnostic: three more %globaltimer stamps in the GEMV's rotated staging (input formed, H_K mixed, transform
done), recorded from thread 0 as a kind-5 record. v27's script rebased on c1f5183, with the K > 1 branch's
first stamp (the row staged in z, after its barrier). Apply trace_warps.diff (v26's, rebased) to a tree first,
then:
    python substep_stamps.py TREE
and build it with QPALETTE_TRACE=1. ../../v27/staging_substeps/substeps.py reads the records."""
import sys

p=sys.argv[1]+'/qpalette/runtime/cuda/qpalette_gemv.cuh'
s=open(p).read()
def rep(old,new):
    global s
    assert old in s, old[:80]
    s=s.replace(old,new)
rep("""                                                const HkRows& hk, int rrank) {""","""                                                const HkRows& hk, int rrank, unsigned long long* ts) {""")
# K>1: stamp after the staged row's barrier (before the mix)
rep("""      else stage_signed_row<T, 8, false>(p, row, reinterpret_cast<T*>(z), mma);
      __syncthreads();""","""      else stage_signed_row<T, 8, false>(p, row, reinterpret_cast<T*>(z), mma);
      __syncthreads();
#ifdef QP_TRACE
      if (row == 0) ts[0] = trace::now();
#endif""")
# K=1: stamp after forming (before the transform)
i=s.index("    } else {\n      if (row > 0) __syncthreads();")
s=s[:i]+"""#ifdef QP_TRACE
      if (row == 0) ts[0] = ts[1] = trace::now();
#endif
"""+s[i:]
rep("""      __syncthreads();  // z is the transform's buffer next
    }""","""      __syncthreads();  // z is the transform's buffer next
#ifdef QP_TRACE
      if (row == 0) ts[1] = trace::now();
#endif
    }""")
i=s.index("  }\n}\n\n// Rotation cluster:")
s=s[:i]+"""#ifdef QP_TRACE
    if (row == 0 || row == rrank) ts[2] = trace::now();
#endif
"""+s[i:]
rep("stage_x_rotated<T, true, PR::FORMS_INPUT, PR::MIX_MMA>(p, xs, rot, rank, hk, rrank);","stage_x_rotated<T, true, PR::FORMS_INPUT, PR::MIX_MMA>(p, xs, rot, rank, hk, rrank, tss);")
rep("stage_x_rotated<T, false, PR::FORMS_INPUT, PR::MIX_MMA>(p, xs, rot, rank, hk, 0);","stage_x_rotated<T, false, PR::FORMS_INPUT, PR::MIX_MMA>(p, xs, rot, rank, hk, 0, tss);")
rep("""  const unsigned long long tr1 = trace::now();
#endif
  if (p.signs) {""","""  const unsigned long long tr1 = trace::now();
#endif
  unsigned long long tss[3] = {0, 0, 0};
  if (p.signs) {""")
rep("""                      (p.signs ? 1ull << 59 : 0ull) | (p.norm_w ? 1ull << 58 : 0ull) | (p.gated ? 1ull << 57 : 0ull));
#endif""","""                      (p.signs ? 1ull << 59 : 0ull) | (p.norm_w ? 1ull << 58 : 0ull) | (p.gated ? 1ull << 57 : 0ull));
  if (threadIdx.x == 0 && p.signs)  // the staging's sub-steps (kind 5): formed (K > 1: staged in z), H_K mixed, transformed
    trace::record(tr1, tss[0], tss[1], tss[2], 5ull << 60 | static_cast<unsigned long long>(blockIdx.x) << 32 |
                                                  static_cast<unsigned long long>(p.cs) << 28 | static_cast<unsigned long long>(p.rt));
#endif""")
open(p,'w').write(s)
