"""``python -m distkit`` is the ``distkit`` command."""
from distkit.cli import entry

entry()
