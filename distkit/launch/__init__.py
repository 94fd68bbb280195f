"""Starting the ranks and cleaning up after them: the ``--nprocs`` spawner (:mod:`.spawner`), ranks forked from
the launching process (:mod:`.forkrank`), the launcher guard (:mod:`.guard`: a rank whose launcher died ends) and the
exit watch (:mod:`.exit_watch`), Open MPI's leftovers (:mod:`.ompi_leftovers`), the network interface the ranks share
(:mod:`.netif`) and the /proc readers they use (:mod:`.procfs`). ``distkit sbatch``, which reads configs, is a command
(:mod:`distkit.commands.sbatch`): the config checks ``nprocs`` here, so launch stays below config.

Imports: ``errors``, ``env`` and each other; nothing of training (no torch at module level)."""
