"""`qpalette eval`: perplexity against a naive per-window computation, data-free KL, CLI errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from shared_data import shared_dir
from typer.testing import CliRunner

from qpalette.calibration.data import bos_token_id, dataset_spec, load_text, sample_model
from qpalette.cli import app
from qpalette.errors import InputError
from qpalette.measure.evaluate import (
    FORMAT,
    kl_to_reference,
    mean_kl,
    perplexity,
    tokenize,
)
from qpalette.runtime.loading import load_model

WIKITEXT = shared_dir() / "data" / "wikitext2_raw_test.txt"
TEXT = (
    " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ "
    "playing video game developed by Sega and Media.Vision for the PlayStation Portable . Released in "
    "January 2011 in Japan , it is the third game in the Valkyria series . Employing the same fusion of "
    "tactical and real @-@ time gameplay as its predecessors , the story runs parallel to the first game "
    "and follows the \" Nameless \" , a penal military unit serving the nation of Gallia .\n"
)
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir, "cpu", torch.float32)


@pytest.fixture()
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT * 3, encoding="utf-8")
    return p


def _naive_ppl(model, ids: torch.Tensor, ctx: int, max_windows: int | None = None) -> tuple[float, int]:
    """exp(mean NLL) over windows ids[i·ctx:(i+1)·ctx], each scored alone, token by token."""
    n = ids.numel() // ctx
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(n):
        w = ids[i * ctx:(i + 1) * ctx]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=w[None]).logits[0].double(), dim=-1)
        for t in range(ctx - 1):
            total -= float(logp[t, w[t + 1]])
            count += 1
    return math.exp(total / count), count


# --------------------------------------------------------------------------- perplexity


def test_perplexity_equals_naive_per_window(tiny):
    model, tok = tiny
    ids = tokenize(tok, TEXT * 3)
    assert ids.numel() == len((TEXT * 3).encode())  # the byte-level fixture: one token per byte
    ctx = 64
    want, count = _naive_ppl(model, ids, ctx)
    r = perplexity(model, ids, ctx=ctx)
    assert r.windows == r.windows_total == ids.numel() // ctx
    assert r.predicted == count == r.windows * (ctx - 1) and r.tokens == r.windows * ctx
    assert r.text_tokens == ids.numel()
    assert r.ppl == pytest.approx(want, rel=1e-6)
    assert r.nll == pytest.approx(math.log(want), rel=1e-6)
    assert 1 < r.ppl < 2 * 257  # a random model: close to uniform over the vocabulary
    # batching windows changes nothing; --max-windows scores a prefix of the same windows
    assert perplexity(model, ids, ctx=ctx, batch_size=3).ppl == pytest.approx(want, rel=1e-6)
    first2, _ = _naive_ppl(model, ids, ctx, max_windows=2)
    r2 = perplexity(model, ids, ctx=ctx, max_windows=2)
    assert r2.windows == 2 and r2.windows_total == r.windows_total
    assert r2.ppl == pytest.approx(first2, rel=1e-6)


def test_perplexity_progress_in_a_log_file_shows_the_running_ppl(tiny, capsys):
    """Progress in a log file (pytest's stderr is not a terminal) takes the same calls as a tqdm bar."""
    model, tok = tiny
    r = perplexity(model, tokenize(tok, TEXT * 3), ctx=64, progress=True)
    err = capsys.readouterr().err
    assert f"perplexity: 100% ({r.windows}/{r.windows} win)" in err and f"[ppl={r.ppl:.3f}]" in err


def test_perplexity_rejects_short_text_and_bad_options(tiny):
    model, tok = tiny
    ids = tokenize(tok, "short")
    with pytest.raises(InputError, match="fewer than one window"):
        perplexity(model, ids, ctx=64)
    with pytest.raises(InputError, match="--ctx"):
        perplexity(model, ids, ctx=1)
    with pytest.raises(InputError, match="max_position_embeddings"):
        perplexity(model, tokenize(tok, TEXT * 8), ctx=1024)


def test_load_text(text_file, monkeypatch):
    text, source = load_text(text_file=text_file)
    assert text == TEXT * 3 and source == "file:text.txt"
    with pytest.raises(InputError, match="no such file"):
        load_text(text_file=text_file.with_name("missing.txt"))
    with pytest.raises(InputError, match="not both"):
        load_text(text_file, "wikitext2")
    with pytest.raises(InputError, match="NAME"):
        load_text(dataset="a:b:c:d")

    import datasets

    seen = {}

    def fake(path, config, split):
        seen["args"] = (path, config, split)
        return datasets.Dataset.from_dict({"text": [" = A = \n", "", " b c \n"]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    text, source = load_text(dataset="wikitext2")
    assert seen["args"] == ("Salesforce/wikitext", "wikitext-2-raw-v1", "test")
    assert text == " = A = \n\n\n\n\n b c \n" and source == "dataset:wikitext2"  # GPTQ: "\n\n".join
    assert load_text() == (text, source)  # the default
    # any `datasets` NAME[:CONFIG[:SPLIT]] too (split "test" when left out)
    text, source = load_text(dataset="wikitext:wikitext-103-raw-v1")
    assert seen["args"] == ("wikitext", "wikitext-103-raw-v1", "test") and source.endswith("103-raw-v1")

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(InputError, match="--text-file"):
        load_text(dataset="wikitext2")
    with pytest.raises(InputError, match="cannot load c4-nonexistent"):
        load_text(dataset="c4-nonexistent")


def test_dataset_spec_aliases_and_datasets_names():
    assert dataset_spec("WikiText-2") == ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", "wikitext2")
    assert dataset_spec("wikitext:wikitext-2-raw-v1:test") == (
        "wikitext", "wikitext-2-raw-v1", "test", "wikitext:wikitext-2-raw-v1:test")
    assert dataset_spec("ptb_text_only::validation")[:3] == ("ptb_text_only", None, "validation")


def test_bos_token_id():
    class Obj:
        def __init__(self, bos):
            self.bos_token_id = bos

    assert bos_token_id(Obj(5), Obj(7)) == 5
    assert bos_token_id(Obj(None), Obj(7)) == 7
    assert bos_token_id(None, Obj([3, 4])) == 3
    assert bos_token_id(None, Obj(None)) == 0


# --------------------------------------------------------------------------- KL


def test_kl_to_itself_is_zero_and_to_a_perturbed_copy_positive(tiny_llama_dir, tiny):
    model, tok = tiny
    ref, ref_tok = load_model(tiny_llama_dir, "cpu", torch.float32)  # a second, separate copy
    same = kl_to_reference(model, ref, ref_tok, num_seqs=4, seq_len=24, seed=3)
    assert same.tokens == 4 * 24 and same.num_seqs == 4 and same.seq_len == 24
    assert abs(same.kl) < 1e-6

    noisy, _ = load_model(tiny_llama_dir, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = noisy.model.layers[1].mlp.down_proj.weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=g))
    k = kl_to_reference(noisy, ref, ref_tok, num_seqs=4, seq_len=24, seed=3)
    assert k.kl > 1e-4
    assert kl_to_reference(noisy, ref, ref_tok, num_seqs=4, seq_len=24, seed=3).kl == pytest.approx(k.kl, rel=1e-9)

    # the same number by hand: KL(ref ‖ model) = Σ p_ref (log p_ref − log p_model), mean over positions
    tokens = sample_model(ref, ref_tok, 4, 24, seed=3, device="cpu")
    assert tokens.shape == (4, 24) and bool((tokens[:, 0] == tok.bos_token_id).all())
    with torch.no_grad():
        lr = F.log_softmax(ref(input_ids=tokens).logits.double(), -1)
        lm = F.log_softmax(noisy(input_ids=tokens).logits.double(), -1)
    by_hand = float((lr.exp() * (lr - lm)).sum(-1).mean())
    assert k.kl == pytest.approx(by_hand, rel=1e-4)
    assert mean_kl(ref, noisy, tokens, batch_tokens=24) == pytest.approx(by_hand, rel=1e-4)  # one seq a batch


# --------------------------------------------------------------------------- the command


def test_cli_perplexity_and_kl(tiny_llama_dir, text_file, tmp_path, tiny):
    model, tok = tiny
    out = tmp_path / "eval.json"
    r = runner.invoke(app, ["eval", str(tiny_llama_dir), "--text-file", str(text_file), "--ctx", "64",
                            "--device", "cpu", "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    want, _ = _naive_ppl(model, tokenize(tok, text_file.read_text()), 64)
    assert doc["format"] == FORMAT and doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert doc["perplexity"]["ppl"] == pytest.approx(want, rel=1e-6) and doc["kl"] is None
    assert "perplexity" in r.output and "tok/s" in r.output and "windows" in r.output

    # a perturbed checkpoint: KL to the original only (no text given: no perplexity)
    noisy_dir = tmp_path / "noisy"
    noisy, _ = load_model(tiny_llama_dir, "cpu", torch.float32)
    with torch.no_grad():
        for p in noisy.model.layers[0].parameters():
            p.mul_(1.3)
    noisy.save_pretrained(noisy_dir)
    tok.save_pretrained(noisy_dir)
    r = runner.invoke(app, ["eval", str(noisy_dir), "--kl-to", str(tiny_llama_dir), "--kl-seqs", "3",
                            "--kl-len", "16", "--device", "cpu", "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["perplexity"] is None and doc["kl"]["kl"] > 1e-4 and doc["kl"]["tokens"] == 48
    assert "nats/token" in r.output
    r = runner.invoke(app, ["eval", str(tiny_llama_dir), "--kl-to", str(tiny_llama_dir), "--kl-seqs", "2",
                            "--kl-len", "16", "--text-file", str(text_file), "--ctx", "64", "--json", str(out),
                            "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert abs(doc["kl"]["kl"]) < 1e-6 and doc["perplexity"]["ppl"] == pytest.approx(want, rel=1e-6)


def test_cli_user_errors_no_traceback(tiny_llama_dir, text_file, tmp_path):
    (tmp_path / "empty_dir").mkdir()
    base = ["eval", str(tiny_llama_dir), "-q"]
    cases = [
        (["eval", str(tiny_llama_dir), "--text-file", str(tmp_path / "missing.txt")], "no such file"),
        (["eval", str(tmp_path / "no_such_model"), "--text-file", str(text_file)], "no such file"),
        (["eval", str(tmp_path / "empty_dir"), "--text-file", str(text_file)], "without config.json"),
        ([*base, "--text-file", str(text_file), "--dataset", "wikitext2"], "not both"),
        ([*base, "--dataset", "a:b:c:d"], "NAME[:CONFIG[:SPLIT]]"),
        ([*base, "--text-file", str(text_file), "--ctx", "100000"], "fewer than one window"),
        ([*base, "--text-file", str(text_file), "--ctx", "1"], "--ctx"),
        ([*base, "--text-file", str(text_file), "--device", "tpu"], "bad --device"),
        ([*base, "--text-file", str(text_file), "--dtype", "int3"], "bad --dtype"),
        ([*base, "--kl-to", str(tmp_path / "no_ref")], "no such file"),
        ([*base, "--kl-to", str(tiny_llama_dir), "--kl-seqs", "0"], "--kl-seqs"),
    ]
    if not torch.cuda.is_available():
        cases.append(([*base, "--text-file", str(text_file), "--device", "cuda"], "no CUDA GPU"))
    for args, msg in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "error:" in r.output and msg in r.output and "Traceback" not in r.output, (args, r.output)


def test_cli_error_in_a_real_process_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "qpalette.cli", "eval", str(tmp_path / "nope"), "--text-file",
                        str(tmp_path / "nope.txt")], check=False, capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    assert p.returncode == 2
    assert "error: --text-file" in p.stderr and "Traceback" not in p.stderr + p.stdout


@pytest.mark.gpu
def test_cuda_matches_cpu(tiny_llama_dir, tiny, text_file, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = tiny
    gpu, _ = load_model(tiny_llama_dir, "cuda", torch.float32)
    ids = tokenize(tok, TEXT * 3)
    want = perplexity(model, ids, ctx=64).ppl
    assert perplexity(gpu, ids, ctx=64, batch_size=2).ppl == pytest.approx(want, rel=1e-4)
    ref, ref_tok = load_model(tiny_llama_dir, "cuda", torch.float32)
    assert abs(kl_to_reference(gpu, ref, ref_tok, num_seqs=4, seq_len=32, seed=1).kl) < 1e-6
    out = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", str(tiny_llama_dir), "--text-file", str(text_file), "--ctx", "64",
                            "--kl-to", str(tiny_llama_dir), "--kl-seqs", "4", "--kl-len", "32", "--json", str(out),
                            "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["device"] == "cuda" and doc["dtype"] == "float16"  # --device/--dtype auto
    assert doc["perplexity"]["ppl"] == pytest.approx(want, rel=1e-2) and abs(doc["kl"]["kl"]) < 1e-6


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_smollm2_wikitext2_windows(smollm2_dir, tmp_path):
    """SmolLM2-135M (float32, CPU): the first 4 windows of 2048 tokens of WikiText-2 test and a short
    KL to itself (≈40 s on 2 cores)."""
    if not WIKITEXT.is_file():
        pytest.skip(f"{WIKITEXT} missing: set QPALETTE_SHARED to the folder holding data/wikitext2_raw_test.txt")
    out = tmp_path / "eval.json"
    r = runner.invoke(app, ["eval", str(smollm2_dir), "--text-file", str(WIKITEXT), "--ctx", "2048",
                            "--max-windows", "4", "--kl-to", str(smollm2_dir), "--kl-seqs", "2", "--kl-len", "32",
                            "--device", "cpu", "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    p = doc["perplexity"]
    assert p["windows"] == 4 and p["tokens"] == 4 * 2048
    assert 280_000 < p["text_tokens"] < 320_000  # the whole file is tokenized once
    assert p["windows_total"] == p["text_tokens"] // 2048
    assert 10 < p["ppl"] < 40, p  # a real small LM on Wikipedia text (uniform would be 49152)
    assert abs(doc["kl"]["kl"]) < 1e-6 and doc["kl"]["tokens"] == 64
