"""``python -m autopar.cli``: the ``autopar`` command line."""

from autopar.cli import app

app()
