"""`python -m specgen ...`, which is what `torchrun -m specgen run RECIPE` starts on every rank."""

from specgen.cli import app

app(prog_name="specgen")
