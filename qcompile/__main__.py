"""``python -m qcompile``: the command line."""
from qcompile.cli import main

main()
