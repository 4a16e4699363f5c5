"""Every error a user can cause derives from `QpaletteError`; the CLI prints its message (no
traceback) and exits with code 2. Anything else is a bug and exits with code 1."""

from __future__ import annotations


class QpaletteError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class InputError(QpaletteError, ValueError):
    """An option or input file (sensitivity, latency profile, distortion table, plan, text) that
    cannot be used."""


class BudgetError(InputError):
    """A --budget string that is not understood."""


class UnknownQuantizer(QpaletteError, KeyError):
    """A palette entry name that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnsupportedShape(QpaletteError, ValueError):
    """A matrix shape a packed format, a kernel or the Hadamard transform cannot hold."""


class CodebookError(QpaletteError):
    """The shipped codebooks are missing or damaged."""


class ModelError(QpaletteError):
    """A model that cannot be found, converted, loaded, or whose architecture is not supported."""


class PlanError(QpaletteError):
    """The planning problem has no answer (or cannot be set up)."""


class InfeasibleBudget(PlanError):
    """No plan fits the budgets; `smallest` holds the smallest feasible value of each."""

    def __init__(self, message: str, smallest: dict[str, float]):
        super().__init__(message)
        self.smallest = smallest


class CheckpointError(QpaletteError, ValueError):
    """A compressed checkpoint (or its quantization_config) that cannot be used."""


class CalibrationError(QpaletteError):
    """A calibration run that cannot start or continue (options, resume files, workers)."""


class CompressError(QpaletteError):
    """A compression run that cannot start or continue (plan, source, output folder)."""


class KernelError(QpaletteError):
    """The CUDA kernels cannot be built or used on this machine."""
