"""What keeps a job honest while it runs: the watchdog (peers lost or stalled, bounded waits;
:mod:`.watchdog`), the one-line errors around user scripts (:mod:`.guards`), preemption (:mod:`.preemption`) and fault
injection for tests (:mod:`.faults`).

Imports: ``launch``, ``errors``; never the Session or an engine (they are typed by protocols)."""
