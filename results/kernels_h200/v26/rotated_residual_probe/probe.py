"""Quality probe (CPU; python probe.py nuq-4,nuq-3 3 → quantizers, WikiText-2 windows of 2048): the product's incoherence scheme (per input group signs + online Hadamard) against a
rotated residual stream (norm weights folded into the readers, the stream rotated by Q = H diag(s) once:
q/k/v and gate/up read it with no online transform; o and down keep theirs), same data-free quantizer."""
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qpalette.measure.evaluate import perplexity, tokenize
from qpalette.quant.incoherence import random_signs, rotate_weight, unrotate_weight
from qpalette.quant.palette.registry import get_quantizer

PATH = os.path.expanduser("~/.cache/qpalette/smollm2-135m-instruct")  # the demo's conversion of SmolLM2-135M-Instruct
torch.manual_seed(0)


def load():
    m = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    m.eval()
    return m


def qdq(w, qname):
    if qname is None:
        return w.float()
    q = get_quantizer(qname)
    return q.dequantize(q.quantize(w.float())).float()


def rotated_qdq(w, s, qname):  # the product: quantize W diag(s) Hᵀ, online H(s ⊙ x)
    return unrotate_weight(qdq(rotate_weight(w, s), qname), s)


def variant_a(model, qname, seed=0):
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for k, lins in enumerate(([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj])):
            s = random_signs(lins[0].in_features, seed * 100000 + i * 10 + k)
            for lin in lins:
                lin.weight.data = rotated_qdq(lin.weight.data, s, qname)


def variant_b(model, qname, seed=0):
    d = model.config.hidden_size
    s_res = random_signs(d, seed * 100000 + 99999)
    read = lambda w: rotate_weight(w, s_res)  # W Qᵀ: the reader of Q h
    write = lambda w: rotate_weight(w.T.contiguous(), s_res).T.contiguous()  # Q W: the writer
    emb = model.model.embed_tokens.weight.data.clone()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(emb.clone())
    model.model.embed_tokens.weight = torch.nn.Parameter(read(emb))  # e → Q e (rows)
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for norm, lins in ((layer.input_layernorm, [a.q_proj, a.k_proj, a.v_proj]),
                           (layer.post_attention_layernorm, [m.gate_proj, m.up_proj])):
            g = norm.weight.data.clone()
            norm.weight.data.fill_(1.0)
            for lin in lins:
                lin.weight.data = qdq(read(lin.weight.data * g), qname)
        for k, lin in ((1, a.o_proj), (3, m.down_proj)):
            s = random_signs(lin.in_features, seed * 100000 + i * 10 + k)
            lin.weight.data = rotated_qdq(write(lin.weight.data), s, qname)
    g = model.model.norm.weight.data.clone()
    model.model.norm.weight.data.fill_(1.0)
    model.lm_head.weight.data = read(model.lm_head.weight.data * g)


def main():
    qnames = sys.argv[1].split(",")
    windows = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    tok = AutoTokenizer.from_pretrained(PATH)
    ids = tokenize(tok, open(os.path.join(os.environ.get("QPALETTE_SHARED", "../shared"), "data/wikitext2_raw_test.txt")).read())
    ev = lambda mdl: perplexity(mdl, ids, ctx=2048, max_windows=windows).ppl
    with torch.no_grad():
        print("fp", ev(load()), flush=True)
        m = load()
        variant_b(m, None)
        print("rotated residual, no quantization", ev(m), flush=True)
        for qn in qnames:
            for name, f in (("online (product)", variant_a), ("rotated residual", variant_b)):
                for seed in (0, 1):
                    t = time.time()
                    m = load()
                    f(m, qn, seed)
                    print(qn, name, "seed", seed, round(ev(m), 4), f"{time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
