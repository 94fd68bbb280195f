"""What keeps a job honest while it runs: the watchdog (peers lost or stalled, bounded waits;
:mod:`.watchdog`, with its heartbeat :mod:`.heartbeat`, its store :mod:`.store`, the end of the job on a host
:mod:`.local_peers`, the lost-peer error :mod:`.lost` and the store's sealed records :mod:`.records`), the one-line
errors around user scripts (:mod:`.guards`), preemption (:mod:`.preemption`) and fault injection for tests
(:mod:`.faults`).

Imports: ``launch``, ``errors``; never the Session or an engine (they are typed by protocols: :mod:`.protocols`)."""
