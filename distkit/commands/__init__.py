"""The ``distkit`` command (:mod:`.cli`) and its subcommands, each imported only when named: ``train`` (in
:mod:`.cli`, on :class:`distkit.Trainer`), ``convert``, ``inspect`` (:mod:`.inspection`), ``export``, ``env``
(:mod:`.envreport`), ``plot``, ``lighthouse``, ``sbatch``.

The top layer: it may import any part of distkit; nothing imports it."""
