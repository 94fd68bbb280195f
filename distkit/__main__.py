"""``python -m distkit`` is the ``distkit`` command."""
import sys

from distkit.cli import main

sys.exit(main())
