"""Front doors where another framework drives the loop, each on the same :class:`distkit.Session`: Lightning's
Trainer and Fabric (:mod:`.lightning`, :mod:`.lightning_fabric`), Accelerate loops (:mod:`.hf`), ``transformers.Trainer``
(:mod:`.hf_trainer`) and the Session's optimizer as those frameworks step it (:mod:`.session_optimizer`).

Users import them by their documented paths, :mod:`distkit.lightning` and :mod:`distkit.hf`; nothing of distkit's
core imports them. Each imports its framework at module level (an optional extra)."""
