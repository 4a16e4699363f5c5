"""The advisory lock on outputs being written (`fileio.output_lock`): a second writer is refused
with the holder's PID, a killed holder's lock is taken over, and compress, calibrate and profile
hold it (and remove it when done)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_compress
from typer.testing import CliRunner

import qpalette
from qpalette.calibration.sensitivity import CalibrateOptions, calibrate
from qpalette.cli import app
from qpalette.errors import CalibrationError, CompressError, QpaletteError
from qpalette.fileio import lock_path, output_lock
from qpalette.measure import profile

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX advisory locks")

# a child that takes the lock on argv[1], says so, and holds it until its stdin closes
HOLDER = """
import sys
from qpalette.fileio import output_lock
with output_lock(sys.argv[1], "qpalette test-holder"):
    print("locked", flush=True)
    sys.stdin.read()
"""


class Holder:
    """Another process holding the lock on `path` for the duration of a `with` block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> subprocess.Popen:
        root = str(Path(qpalette.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(self.path)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"
        return self.proc

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    out = tmp_path / "OUT"
    with Holder(out) as child:
        assert lock_path(out) == tmp_path / "OUT.lock" and lock_path(out).is_file()
        with pytest.raises(QpaletteError, match=rf"OUT is being written by another qpalette process "
                                                rf"\(PID {child.pid}, qpalette test-holder\); wait for it"):
            with output_lock(out, "qpalette compress"):
                pass
        with pytest.raises(CompressError, match=str(child.pid)):  # the caller's error class
            with output_lock(out, "qpalette compress", CompressError):
                pass
    assert child.returncode == 0 and not lock_path(out).exists()  # removed by its holder
    with output_lock(out, "qpalette compress") as lock:  # free again
        assert lock.read_text() == f"{os.getpid()}\nqpalette compress\n"
    assert not lock.exists()


def test_a_lock_is_exclusive_within_one_process_too(tmp_path):
    with output_lock(tmp_path / "sens.json", "one") as lock:
        assert lock == tmp_path / "sens.json.lock"
        with pytest.raises(QpaletteError, match=rf"PID {os.getpid()}, one"):
            with output_lock(tmp_path / "sens.json", "two"):
                pass
        assert lock.read_text() == f"{os.getpid()}\none\n"  # the refused one changed nothing
    assert not lock.exists()


def test_the_lock_of_a_killed_holder_is_taken_over(tmp_path):
    out = tmp_path / "OUT"
    with Holder(out) as child:
        child.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
        assert child.wait(timeout=30) == -signal.SIGKILL
    assert str(child.pid) in lock_path(out).read_text()  # stale file, but no lock on it
    with output_lock(out, "qpalette compress") as lock:
        assert lock.read_text() == f"{os.getpid()}\nqpalette compress\n"
    assert not lock.exists()


def test_the_lock_is_released_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with output_lock(tmp_path / "x", "w"):
            raise RuntimeError
    assert not lock_path(tmp_path / "x").exists()
    with output_lock(tmp_path / "x", "w"):
        pass


def test_no_lock_where_none_can_be_taken(tmp_path, monkeypatch):
    import errno

    from qpalette import fileio

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fileio.fcntl, "flock", no_locks)  # e.g. a file system without locks
    with output_lock(tmp_path / "x", "w") as lock:
        assert lock is None
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(fileio, "fcntl", None)  # not POSIX
    with output_lock(tmp_path / "x", "w") as lock:
        assert lock is None


def test_compress_refuses_an_output_being_written(tiny_llama_dir, tmp_path):
    out = tmp_path / "q"
    with Holder(out) as child:
        with pytest.raises(CompressError, match=rf"being written by .*PID {child.pid}"):
            run_compress(tiny_llama_dir, out, scheme="nuq-4")
        with pytest.raises(CompressError, match=str(child.pid)):  # --resume cannot share OUT.partial
            run_compress(tiny_llama_dir, out, scheme="nuq-4", resume=True)
        res = CliRunner().invoke(app, ["compress", str(tiny_llama_dir), "-o", str(out), "-s", "nuq-4", "-q"])
        assert res.exit_code == 2 and f"PID {child.pid}" in res.output and "Traceback" not in res.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["q.lock"]  # nothing written


def test_compress_leaves_no_lock(tiny_llama_dir, tmp_path):
    run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
    with pytest.raises(CompressError, match="already exists"):  # a refused run removes its lock too
        run_compress(tiny_llama_dir, tmp_path / "q", scheme="nuq-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def _opts(model_dir, out, **kw):
    base = dict(model=str(model_dir), output=out, num_seqs=2, seq_len=16, levels=2, seed=0,
                devices=["cpu"], batch_size=2, progress=False, layers=r"layers\.0\.self_attn\.q_proj")
    base.update(kw)
    return CalibrateOptions(**base)


def test_calibrate_refuses_an_output_being_written(tiny_llama_dir, tmp_path):
    out = tmp_path / "sens.json"
    with Holder(out) as child:
        with pytest.raises(CalibrationError, match=rf"sens.json is being written by .*PID {child.pid}"):
            calibrate(_opts(tiny_llama_dir, out), log=lambda m: None)
        with pytest.raises(CalibrationError, match=str(child.pid)):
            calibrate(_opts(tiny_llama_dir, out, resume=True), log=lambda m: None)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sens.json.lock"]  # no resume files


def test_calibrate_leaves_no_lock(tiny_llama_dir, tmp_path):
    out = tmp_path / "sens.json"
    doc = calibrate(_opts(tiny_llama_dir, out), log=lambda m: None)
    assert list(doc["layers"]) == ["model.layers.0.self_attn.q_proj"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sens.json"]


@pytest.fixture
def fake_profile(monkeypatch):
    """run_profile without a GPU: the measurements replaced by constants."""
    monkeypatch.setattr(profile, "_require_kernels", lambda: None)
    monkeypatch.setattr(profile.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(profile, "measure_constant", lambda cfg, m, dtype, say: (1e-3, {}))
    monkeypatch.setattr(profile.kernel_timing, "time_quantized",
                        lambda name, rows, cols, bs, dtype: ({m: 1e-5 for m in bs}, None))


def test_profile_locks_each_output_file(tiny_llama_dir, tmp_path, fake_profile):
    target = tmp_path / "latency_tiny_b8.json"
    with Holder(target) as child:
        with pytest.raises(QpaletteError, match=rf"latency_tiny_b8.json is being written by .*PID {child.pid}"):
            profile.run_profile(str(tiny_llama_dir), [1, 8], tmp_path, entries=["nuq-4"], name="tiny",
                                say=lambda m: None)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latency_tiny_b8.json.lock"]
        # another batch size of the same model may be written beside it meanwhile
        written = profile.run_profile(str(tiny_llama_dir), [1], tmp_path, entries=["nuq-4"], name="tiny",
                                      say=lambda m: None)
        assert written == [tmp_path / "latency_tiny_b1.json"]
    profile.run_profile(str(tiny_llama_dir), [1, 8], tmp_path, entries=["nuq-4"], name="tiny", say=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latency_tiny_b1.json", "latency_tiny_b8.json"]
