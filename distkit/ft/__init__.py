"""Replica groups that survive failures (``fault_tolerance = {...}``): torchft's Manager around the cross-group
sync (:mod:`.groups`), what is adapted of torchft (:mod:`.torchft_parts`), the lighthouse's status and heartbeats
inside a sync (:mod:`.watch`), the training state a heal carries (:mod:`.state`) and the lighthouse process
(:mod:`.lighthouse`, started by ``distkit lighthouse``), the syncs that do not wait for the late
(:mod:`.late`, ``fault_tolerance.late = 'merge'``) and the compressed exchange across the groups
(:mod:`.codec_exchange`, ``distributed.param_sync_compression``).

Imports: ``sync``, ``health``, ``launch``, ``env``, ``errors``; never the Session or an engine."""
