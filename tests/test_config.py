"""The versioned step configs: the CLI records exactly `config.to_dict()` in what it writes, the
config loads back from there, and running the API on the loaded config repeats the run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import qpalette
from qpalette.cli import app
from qpalette.config import CalibrateConfig, CompressConfig, PlanConfig
from qpalette.errors import InputError
from qpalette.planning.document import Plan
from qpalette.quant.ldlq import DEFAULT_DAMP

runner = CliRunner()


def cli(*args: str) -> None:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def pipeline(tiny_llama_dir, tmp_path_factory):
    """calibrate → plan → compress on the tiny model through the command line."""
    d = tmp_path_factory.mktemp("configs")
    cli("calibrate", tiny_llama_dir, "-o", d / "sens.json", "-n", "4", "--seq-len", "32", "--levels", "3",
        "--t-max", "0.5", "--seed", "3", "--ignore", "down_proj", "--device", "cpu", "-q")
    cli("plan", tiny_llama_dir, "-s", d / "sens.json", "-b", "3.5bits", "-p", "nuq,vq", "--no-fuse",
        "--ignore", "down_proj", "-o", d / "plan.json", "--no-plot")
    cli("compress", tiny_llama_dir, "-p", d / "plan.json", "-o", d / "q", "--seed", "5", "--no-fuse",
        "--device", "cpu", "-q")
    return d


def test_the_cli_records_exactly_the_config(pipeline):
    want = {
        pipeline / "sens.json": CalibrateConfig(num_seqs=4, seq_len=32, levels=3, t_max=0.5, seed=3,
                                                ignore=["down_proj"]),
        pipeline / "plan.json": PlanConfig(budget=["3.5bits"], palette=["nuq,vq"], fuse=False, ignore=["down_proj"]),
        pipeline / "q" / "qpalette-compress.json": CompressConfig(fuse=False, sign_seed=5),
    }
    for path, config in want.items():
        assert json.loads(path.read_text())["config"] == config.to_dict()
        assert type(config).load(path) == config
    assert CompressConfig.load(pipeline / "q") == want[pipeline / "q" / "qpalette-compress.json"]
    assert Plan.load(pipeline / "plan.json").config == want[pipeline / "plan.json"]


def test_the_api_repeats_a_run_from_its_recorded_config(pipeline, tiny_llama_dir, tmp_path):
    sens = qpalette.calibrate(str(tiny_llama_dir), tmp_path / "sens.json", CalibrateConfig.load(pipeline / "sens.json"),
                              devices="cpu", progress=False)
    first = json.loads((pipeline / "sens.json").read_text())
    assert {n: v["a"] for n, v in sens["layers"].items()} == {n: v["a"] for n, v in first["layers"].items()}
    plan = qpalette.plan(str(tiny_llama_dir), config=PlanConfig.load(pipeline / "plan.json"),
                         sensitivity=pipeline / "sens.json", output=tmp_path / "plan.json")
    assert plan.assignment() == Plan.load(pipeline / "plan.json").assignment()
    assert not any(n.endswith("down_proj") for n in plan.assignment())  # the recorded ignore applied
    qpalette.compress(str(tiny_llama_dir), tmp_path / "plan.json", tmp_path / "q",
                      CompressConfig.load(pipeline / "q"), device="cpu", quiet=True)
    for shard in sorted((pipeline / "q").glob("*.safetensors")):
        assert (tmp_path / "q" / shard.name).read_bytes() == shard.read_bytes()


def test_keywords_override_the_config():
    base = PlanConfig(budget=["3bits"], fuse=False)
    assert base.updated(lm_head="keep") == PlanConfig(budget=["3bits"], fuse=False, lm_head="keep")
    with pytest.raises(InputError, match="no option budgets"):
        base.updated(budgets=["3bits"])
    with pytest.raises(InputError, match="no option num_seq"):
        qpalette.calibrate("nowhere", "x.json", num_seq=4)


@pytest.mark.parametrize("change,message", [
    ({"version": 2}, "newer qpalette"),
    ({"version": "1"}, "positive integer"),
    ({"type": "PlanConfig"}, "expected 'CalibrateConfig'"),
    ({"levels": "16"}, "levels = '16' is not int"),
    ({"levels": True}, "is not int"),
    ({"t_max": None}, "is not float"),
    ({"layer_regex": "q_proj"}, "unknown field"),
])
def test_a_bad_config_is_refused_in_one_line(change, message):
    with pytest.raises(InputError, match=message):
        CalibrateConfig.from_dict({**CalibrateConfig().to_dict(), **change})


def test_missing_fields_take_their_defaults_and_files_without_a_config_say_so(tmp_path):
    assert CalibrateConfig.from_dict({"type": "CalibrateConfig", "version": 1, "levels": 4}) == CalibrateConfig(levels=4)
    (tmp_path / "old.json").write_text(json.dumps({"format": "qpalette.sensitivity/1", "layers": {}}))
    with pytest.raises(InputError, match="records no config"):
        CalibrateConfig.load(tmp_path / "old.json")
    (tmp_path / "alone.json").write_text(json.dumps(CompressConfig(scheme="tcq-3.0").to_dict()))
    assert CompressConfig.load(tmp_path / "alone.json").scheme == "tcq-3.0"


def test_defaults_match_the_library():
    assert CompressConfig().damp == DEFAULT_DAMP
