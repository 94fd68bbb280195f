"""``python -m distkit`` is the ``distkit`` command."""
from distkit.commands.cli import entry

entry()
