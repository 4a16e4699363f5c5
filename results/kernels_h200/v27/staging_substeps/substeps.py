#!/usr/bin/env python3
"""Per-place medians of the kind-5 records (substep_stamps.py) of trace_step.py's last recorded step:
    python substeps.py trace.json.gz [more.json.gz]
µs from the CTA passing griddepcontrol.wait to the input formed, then the mix, then the transform."""
import gzip
import json
import sys
from statistics import median

NAMES={384:"qkv",1792:"gateup",8016:"lm_head"}
def name(r):
    rt=r[4]&0xFFFFFF; cs=(r[4]>>28)&0xF
    return NAMES.get(rt,"o" if cs==1 else "down")
for f in sys.argv[1:]:
    d=json.load(gzip.open(f)); g=d['gemv']
    k5=sorted([r for r in g if (r[4]>>60)==5], key=lambda r:r[0]); k5=k5[2*len(k5)//3:]
    by={}
    for r in k5: by.setdefault(name(r),[]).append(r)
    print(f, d['step_ms'])
    for k in ("qkv","o","gateup","down"):
        v=by[k]
        f_=median((r[1]-r[0])/1e3 for r in v); m=median((r[2]-r[1])/1e3 for r in v); t=median((r[3]-r[2])/1e3 for r in v)
        print("  %-7s formed %.2f  mixed %.2f  transformed %.2f  (to end of rotation %.2f)"%(k,f_,m,t,median((r[3]-r[0])/1e3 for r in v)))
