"""Param mode, the same on every engine: the averager (local steps, periodic averaging, the outer optimizer,
fragments; :mod:`.averager`), the codecs of the exchange (:mod:`.compression`) and replica groups
(:mod:`.replicas`). The averager sees named fp32 tensors and an all-reduce (:class:`.averager.Reducer`), never an
engine.

Imports: ``errors`` and torch only."""
