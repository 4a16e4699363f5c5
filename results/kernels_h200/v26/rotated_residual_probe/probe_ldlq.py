"""The probe of probe.py with the data-aware path: LDLQ with each layer's input second moment, collected
from the float model of each scheme (16 WikiText-2 validation sequences of 512 tokens), in the basis of
the weight it quantizes. python probe_ldlq.py nuq-4,nuq-3 3"""
import os
import sys
import time

import torch
from probe import PATH, load, variant_b
from transformers import AutoTokenizer

from qpalette.measure.evaluate import perplexity, tokenize
from qpalette.quant.incoherence import random_signs, rotate_hessian, rotate_weight, unrotate_weight
from qpalette.quant.ldlq import ldl_feedback, ldlq
from qpalette.quant.palette.registry import get_quantizer

SHARED = os.environ.get("QPALETTE_SHARED", "../shared")


def second_moments(model, ids):
    """E[x xᵀ] of every linear layer's input over the calibration tokens."""
    acc, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            def hook(m, inp, out, name=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                h, n = acc.get(name, (0, 0))
                acc[name] = (h + x.T @ x, n + x.shape[0])
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        for s in range(16):
            model(ids[s * 512:(s + 1) * 512][None])
    for h in hooks:
        h.remove()
    return {k: (h / n).float() for k, (h, n) in acc.items()}


def ldlq_qdq(w, h, qname):
    q = get_quantizer(qname)
    return q.dequantize(ldlq(q, w.float(), ldl_feedback(h, q.block_cols))).float()


def rotated_ldlq(w, h, s, qname):
    return unrotate_weight(ldlq_qdq(rotate_weight(w, s), rotate_hessian(h, s), qname), s)


def quantize_a(model, hs, qname, seed):
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        groups = (("self_attn.q_proj", [a.q_proj, a.k_proj, a.v_proj]), ("self_attn.o_proj", [a.o_proj]),
                  ("mlp.gate_proj", [m.gate_proj, m.up_proj]), ("mlp.down_proj", [m.down_proj]))
        for k, (key, lins) in enumerate(groups):
            s = random_signs(lins[0].in_features, seed * 100000 + i * 10 + k)
            h = hs[f"model.layers.{i}.{key}"]
            for lin in lins:
                lin.weight.data = rotated_ldlq(lin.weight.data, h, s, qname)


def quantize_b(model, hs, qname, seed):  # model: variant_b(·, None) already applied
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for key, lins in (("self_attn.q_proj", [a.q_proj, a.k_proj, a.v_proj]), ("mlp.gate_proj", [m.gate_proj, m.up_proj])):
            for lin in lins:
                lin.weight.data = ldlq_qdq(lin.weight.data, hs[f"model.layers.{i}.{key}"], qname)
        for k, key, lin in ((1, "self_attn.o_proj", a.o_proj), (3, "mlp.down_proj", m.down_proj)):
            s = random_signs(lin.in_features, seed * 100000 + i * 10 + k)
            lin.weight.data = rotated_ldlq(lin.weight.data, hs[f"model.layers.{i}.{key}"], s, qname)


def main():
    qnames, windows = sys.argv[1].split(","), int(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(PATH)
    test = tokenize(tok, open(os.path.join(SHARED, "data/wikitext2_raw_test.txt")).read())
    calib = tokenize(tok, open(os.path.join(SHARED, "data/wikitext2_valid_tokens.txt")).read())
    ev = lambda mdl: perplexity(mdl, test, ctx=2048, max_windows=windows).ppl
    ha = second_moments(load(), calib)
    mb = load()
    variant_b(mb, None, 0)
    hb = second_moments(mb, calib)
    with torch.no_grad():
        for qn in qnames:
            for name in ("online (product)", "rotated residual"):
                for seed in (0, 1):
                    t = time.time()
                    m = load()
                    if name == "online (product)":
                        quantize_a(m, ha, qn, seed)
                    else:
                        variant_b(m, None, 0)
                        quantize_b(m, hb, qn, seed)
                    print(qn, "ldlq", name, "seed", seed, round(ev(m), 4), f"{time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
