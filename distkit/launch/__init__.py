"""Starting the ranks and cleaning up after them: the ``--nprocs`` spawner (:mod:`.spawner`), ranks forked from
the launching process (:mod:`.forkrank`), the launcher guard (:mod:`.guard`: a rank whose launcher died ends) and the
exit watch (:mod:`.exit_watch`), Open MPI's leftovers (:mod:`.ompi_leftovers`), the network interface the ranks share
(:mod:`.netif`), ``distkit sbatch`` (:mod:`.sbatch`) and the /proc readers they use (:mod:`.procfs`).

Imports: ``errors``, ``lazy_import`` and each other; nothing of training (no torch at module level)."""
