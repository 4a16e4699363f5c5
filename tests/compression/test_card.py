"""The model card: the load instructions, and `base_model:` metadata when the source's hub id is known."""

import shutil

import pytest
from helpers import run_compress

from qpalette.models.sources import hub_id


@pytest.mark.parametrize("spec,want", [
    ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
    ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("SmolLM2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("./not/here", None),
    ("model.gguf", None),
    ("a/b/c", None),
])
def test_hub_id_of_a_spec(spec, want):
    assert hub_id(spec) == want


def test_hub_id_of_local_folders(tmp_path):
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc123"
    default = tmp_path / "smollm2-135m-instruct"
    other = tmp_path / "my-model"
    for d in (snapshot, default, other):
        d.mkdir(parents=True)
    assert hub_id(snapshot) == "meta-llama/Llama-3.1-8B"
    assert hub_id(default) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id(other) is None


def test_the_card_names_its_base_model(tiny_llama_dir, tmp_path):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "models--org--tiny" / "snapshots" / "0")
    run_compress(src, tmp_path / "q", scheme="nuq-4")
    head = (tmp_path / "q" / "README.md").read_text().split("---")[1]
    assert "base_model: org/tiny\nbase_model_relation: quantized\n" in head
    run_compress(tiny_llama_dir, tmp_path / "plain", scheme="nuq-4")
    assert "base_model" not in (tmp_path / "plain" / "README.md").read_text()
