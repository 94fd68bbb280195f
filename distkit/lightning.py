"""The documented path of the Lightning bridge (``from distkit.lightning import DistkitStrategy``): the code is
:mod:`distkit.integrations.lightning` (the Trainer strategy) and :mod:`distkit.integrations.lightning_fabric` (Fabric).
Importing this module imports Lightning."""
from distkit.integrations.lightning import DistkitFabricStrategy, DistkitStrategy

__all__ = ["DistkitStrategy", "DistkitFabricStrategy"]
