from fxpar.cli import run

run()
