"""`python -m qpalette` = the `qpalette` command (torchrun: `torchrun ... -m qpalette compress ...`)."""

from qpalette.cli import app

app(prog_name="qpalette")
