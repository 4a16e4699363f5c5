"""Count what the reliability suites try, by running them: bad inputs and the errors they give,
damaged checkpoints and plans, and kill points × commands resumed.

    python scripts/reliability_counts.py [--json counts.json] [-- PYTEST ARGS]

While the suites run, every `QpaletteError` constructed is recorded (a user error: its message
must be one line), and every command invoked in-process (`qpalette.cli`) is recorded with how it
ended: done, a one-line error (exit code 2), or an exception that escaped (a traceback, exit
code 1). Kill points are the parametrized cases of the `test_sigkill_*` tests, one test module per
command; damaged inputs are the cases of tests/compression/test_corruption.py. Subprocesses (the
kill drivers) are counted by their tests' outcome, not traced.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KILL_SUITES = {  # command → its fault-injection module
    "compress": "tests/compression/test_compress_faults.py",
    "calibrate": "tests/calibration/test_calibrate_faults.py",
    "hessians": "tests/calibration/test_hessians_faults.py",
    "profile": "tests/measure/test_profile_faults.py",
}
CORRUPTION = "tests/compression/test_corruption.py"
INPUT_SUITES = [  # where bad inputs are tried, beside the two above
    "tests/test_locking.py", "tests/test_config.py", "tests/test_cli_json.py", "tests/planning/test_planner.py",
    "tests/compression/test_writer.py", "tests/compression/test_in_memory.py", "tests/calibration/test_sensitivity.py",
    "tests/calibration/test_hessians.py", "tests/generation/test_generate_cli.py", "tests/measure/test_profile.py",
]


class Recorder:
    """A pytest plugin: test outcomes, user errors raised, and how in-process commands ended."""

    def __init__(self):
        self.outcomes: dict[str, str] = {}
        self.errors: list[tuple[str, str, str]] = []  # (test, error class, message)
        self.commands: Counter = Counter()
        self.escaped: list[tuple[str, str]] = []  # (test, exception) of commands that ended in a traceback
        self.current = ""

    def pytest_sessionstart(self, session):
        from qpalette import cli, errors

        recorder, init, invoke = self, errors.QpaletteError.__init__, cli._Commands.invoke

        def record_error(err, *args, **kw):
            init(err, *args, **kw)
            recorder.errors.append((recorder.current, type(err).__name__, str(err)))

        def record_command(group, ctx):
            try:
                result = invoke(group, ctx)
            except SystemExit as e:
                recorder.commands["exit 0" if not e.code else f"exit {e.code}"] += 1
                raise
            except Exception as e:  # click's exits are Exceptions too: sort them from tracebacks
                code = getattr(e, "exit_code", None)
                if code is None:
                    recorder.escaped.append((recorder.current, f"{type(e).__name__}: {e}"))
                    recorder.commands["traceback"] += 1
                else:
                    recorder.commands[f"exit {code}"] += 1
                raise
            recorder.commands["exit 0"] += 1
            return result

        errors.QpaletteError.__init__ = record_error
        cli._Commands.invoke = record_command

    def pytest_runtest_setup(self, item):
        self.current = item.nodeid

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome


def cases(outcomes: dict[str, str], module: str, prefix: str = "") -> dict[str, int]:
    """Passed / failed / skipped counts of the test cases of `module` whose name starts with `prefix`."""
    picked = [o for n, o in outcomes.items() if n.startswith(f"{module}::{prefix}")]
    return {k: picked.count(k) for k in ("passed", "failed", "skipped")}


def summary(rec: Recorder) -> dict:
    one_line = [e for e in rec.errors if e[2] and "\n" not in e[2]]
    return {
        "kill_points": {cmd: cases(rec.outcomes, mod, "test_sigkill") for cmd, mod in KILL_SUITES.items()},
        "corruptions": cases(rec.outcomes, CORRUPTION, "test_") | {
            "errors_raised": sum(1 for e in rec.errors if e[0].startswith(CORRUPTION))},
        "bad_inputs": {"user_errors_raised": len(rec.errors), "one_line": len(one_line),
                       "distinct_messages": len({e[2] for e in rec.errors}),
                       "by_class": dict(Counter(e[1] for e in rec.errors).most_common())},
        "commands_in_process": dict(rec.commands),
        "tracebacks": rec.escaped,
        "multi_line_errors": [e for e in rec.errors if e not in one_line],
        "tests": dict(Counter(rec.outcomes.values())),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="Also write the counts to this file.")
    ap.add_argument("pytest_args", nargs="*", help="Extra pytest arguments (after --).")
    args = ap.parse_args()
    rec = Recorder()
    suites = [*KILL_SUITES.values(), CORRUPTION, *INPUT_SUITES]
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *[str(ROOT / s) for s in suites],
                        *args.pytest_args], plugins=[rec])
    counts = summary(rec)
    print(json.dumps({k: v for k, v in counts.items() if k != "multi_line_errors"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1) + "\n")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
