"""Syncs that do not wait for the late (``fault_tolerance.late = 'merge'``; Decoupled DiLoCo, arXiv 2604.21428):
what fault-tolerant groups add to torchft's quorum so that a sync goes ahead without a late group and the late
group's work is merged, not thrown away.

What torchft gives. Its lighthouse forms a sync's quorum without a group that is alive (heartbeating) but has not
asked once ``--min-replicas`` groups asked and ``--join-timeout`` passed since the first of them did, provided more
than half of the heartbeating groups asked (its split-brain rule: of 2 groups a late one is always waited for). A
quorum whose members are all those of the previous one forms at once ("fast quorum"), with whoever else asked.
The late group's request then waits at the lighthouse and is in the next quorum the others form, where torchft
*heals* it: its period is replaced by a live group's state.

What is added here, at each sync of each rank:

* **The grace window, kept by the groups** (:meth:`LateMerge.arrive`). Before asking for the quorum, the members
  of the last quorum meet in its store (the one torchft's gloo group met in): each adds its arrival and waits until
  all have arrived or ``grace_s`` (or ``grace_fraction`` of this group's period: the time since its last sync)
  passed, then asks. A group that the last quorum went ahead without (the lighthouse's /status page says so) does
  not ask at once: it says so in that store and waits there until the members arrive for their next sync, then
  asks just before them. Why: a request waiting at the lighthouse counts as joined since it came, so the next
  quorum (not fast: it has a member the last one lacked) would form the moment one other group asks, long past any
  join timeout, and leave the rest out in turn, sync after sync. Asking together, the groups get torchft's fast
  quorum (every member of the last one asked), the late group in it. The lighthouse's ``--join-timeout`` adds to
  the grace: best short (1 s). At the run's last step the members wait for every one that still heartbeats.
* **The anchor and the weight.** Every group keeps its *anchor* (the averaged tensors as of its last merged sync,
  float32) and the samples it had trained on then. At a sync each group sends ``w * (anchor - model)`` and ``w``
  (``w``: samples since its last merged sync), summed over the quorum; the new model is
  ``base - sum(w_i * d_i) / sum(w_i)``, ``base`` the anchor of the groups that committed the last sync. With every
  group on time and equal batches that is the plain mean (rounded differently: ``late = 'heal'`` keeps today's
  bit-for-bit parity with one job).
* **The late group's pseudo-gradient.** A group behind (torchft asks it to heal) that holds an anchor sends its
  pseudo-gradient from its own, older anchor with its weight (its whole period) and takes part in the sum although
  torchft would zero it; it then heals as before (optimizer, counters, data position from a live group) and takes
  that group's anchor (carried in the torchft part of the heal: the Manager's ``state_dict``) as its ``base``: every
  group of the quorum computes the same ``base`` and sum, so all end bit-identical. A group without an anchor (one
  that restarted without a checkpoint) or behind by more than one sync heals and sends nothing, as with
  ``late = 'heal'``.

The first sync (no group committed one yet: no anchor anywhere) is the plain average. The anchor and its samples
are in the Manager's state, hence in checkpoints: a resumed group merges its pseudo-gradient too.

``DISTKIT_FT_PSEUDOGRADIENTS=DIR`` (tests): at every merged sync each rank saves what it sent and got to
``DIR/group<G>-rank<R>-step<S>.pt``; a rank of a group left out of the last quorum creates
``DIR/group<G>-rank<R>-late-quorum<ID>`` when it starts waiting for that quorum's members.
"""
from __future__ import annotations

import contextlib
import datetime
import html
import os
import re
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch

from distkit.errors import DistkitError

#: the slots after the weighted pseudo-gradients: the weights' sum, the groups that sent one, the late ones of those
_TAIL = 3
#: seconds between two looks at the arrivals of the groups (:meth:`LateMerge.arrive`)
POLL_S = 0.02
#: seconds the members of the last quorum wait, once a group it went ahead without said it asked, before they ask
#: (its request travels to the lighthouse through its group's Manager server)
ASKED_S = 0.1
#: default ``fault_tolerance.grace_s``
GRACE_S = 2.0
#: the previous quorum on the lighthouse's /status page: its id, and each member's replica id, the step it asked with
#: and its store's address
_QUORUM_ID = re.compile(r"Previous quorum id:\s*(\d+)")
_MEMBER = re.compile(r"<b>\s*([^<\s]+)\s*</b>\s*<br/>\s*Step:\s*(-?\d+)\s*<br/>\s*Manager:[^<]*<br/>\s*"
                     r"TCPStore:\s*([^<\s]+)")


def previous_quorum(status: str) -> Optional[tuple[int, list[tuple[str, int, str]]]]:
    """The previous quorum on a lighthouse's /status page: (its id, [(replica id, step, store address)] in its
    order), or None."""
    text = html.unescape(status)
    found = _QUORUM_ID.search(text)
    if found is None:
        return None
    members = [(r, int(s), a) for r, s, a in _MEMBER.findall(text[found.end():])]
    return (int(found.group(1)), members) if members else None


def group_of(replica_id: str) -> int:
    """distkit's group number of a torchft replica id (``distkit_group_<N>:<uuid>``); -1 for another's."""
    m = re.match(r"distkit_group_(\d+)(:|$)", replica_id)
    return int(m.group(1)) if m else -1


class LateMerge:
    """A rank's anchor and the weighted pseudo-gradient exchange of ``late = 'merge'`` (module docstring), around
    its torchft ``manager`` (whose ``state_dict``/``load_state_dict`` it extends with the anchor); ``samples_of()``:
    the samples the group has trained on so far."""

    def __init__(self, manager: Any, samples_of: Callable[[], int], ft: dict[str, Any], rank: int,
                 final_of: Callable[[], bool] = lambda: False) -> None:
        self._manager, self._samples_of, self._rank, self._final_of = manager, samples_of, rank, final_of
        self.grace_s = float(ft.get("grace_s", GRACE_S))
        self.grace_fraction: Optional[float] = ft.get("grace_fraction")
        #: the last quorum this group committed a sync in: (its store's address, its id, the syncs committed after
        #: it, its members' replica ids): where its members meet before the next sync (:meth:`arrive`)
        self._last: Optional[tuple[str, int, int, list[str]]] = None
        #: this sync: (store, key) where this group, left out of the last quorum, says it asked (:meth:`asked`)
        self._asking: Optional[tuple[Any, str]] = None
        self._stores: dict[str, Any] = {}
        self._since = time.monotonic()  # the end of this group's last sync (its period: grace_fraction)
        #: the model (the tensors the syncs average, flat, float32) as of this group's last merged sync; None
        #: before the first
        self.anchor: Optional[torch.Tensor] = None
        #: ``samples_of()`` at that sync
        self.samples = 0
        #: (anchor, samples) a healing group received from a live one (torchft's quorum thread): its base once
        #: the sync commits
        self._received: Optional[tuple[Optional[torch.Tensor], int]] = None
        #: this sync: this group merges late (torchft asked it to heal; it holds an anchor)
        self.was_late = False
        self._sent: dict[str, Any] = {}  # this sync: what this rank sent (for the dump)
        self._dump = os.environ.get("DISTKIT_FT_PSEUDOGRADIENTS", "")
        state_dict, load_state_dict = manager.state_dict, manager.load_state_dict

        def with_anchor() -> dict[str, Any]:
            return {**state_dict(), "late_anchor": self.anchor, "late_samples": self.samples}

        def load(state: dict[str, Any]) -> None:
            load_state_dict(state)
            if "late_anchor" not in state:  # (groups.py's own restore of the step after a failed heal)
                return
            anchor = state["late_anchor"]
            got = (anchor.detach().clone().float() if anchor is not None else None, int(state["late_samples"]))
            if threading.current_thread() is threading.main_thread():
                self.anchor, self.samples = got  # a checkpoint's (resume)
            else:
                self._received = got  # a heal's (torchft's quorum thread): applied if the sync commits

        manager.state_dict, manager.load_state_dict = with_anchor, load

    def grace(self) -> float:
        """This sync's grace window (seconds): ``grace_fraction`` of this group's period, else ``grace_s``."""
        if self.grace_fraction is not None:
            return float(self.grace_fraction) * (time.monotonic() - self._since)
        return self.grace_s

    def _store(self, address: str, timeout_s: float) -> Any:
        """A client of the store at ``address`` (the last quorum's: the one torchft's gloo group met in), each call
        bounded by ``timeout_s`` (a store whose group is frozen accepts and never answers)."""
        store = self._stores.get(address)
        if store is None:
            from torchft.process_group import create_store_client

            store = create_store_client(f"{address}/distkit/arrive", datetime.timedelta(seconds=max(0.5, timeout_s)))
            self._stores = {address: store}  # (one: the last quorum's)
        return store

    def arrive(self, status_of: Callable[[], tuple[Optional[str], str]], group: int, step: int,
               timeout_s: float) -> float:
        """Before this rank asks for a sync's quorum (``step``: its group's committed syncs; ``status_of()``: the
        lighthouse's /status page, or why not; ``timeout_s``: the longest wait for a quorum). Returns the seconds
        waited. Best effort: a store that does not answer (its group died) ends the wait at once.

        * A member of the last quorum: adds its arrival in that quorum's store and waits until every member arrived
          or the grace window passed (at the last step: every member that still heartbeats); then, where groups that
          the last quorum went ahead without wait to join (below), lets them ask first (their requests are then in
          the lighthouse, fresh, when this one comes: the quorum is fast, every member of the last one asked).
        * A group that the last quorum went ahead without (the lighthouse's page: it is not a member, which asked
          with ``step`` committed syncs or more): says so in that quorum's store and waits until its members have
          arrived for their next sync (at most ``timeout_s``), then asks with them (:meth:`asked`). Asking at once, its
          request would wait at the lighthouse counted as joined since it came, and the next quorum (not fast) would
          form the moment one other group asks, leaving the rest out in turn."""
        t0 = time.monotonic()
        self._asking = None
        why, status = status_of()
        prev = previous_quorum(status) if why is None else None
        try:
            if prev is not None and prev[1] and all(group_of(r) != group for r, _, _ in prev[1]) \
                    and max(s for _, s, _ in prev[1]) >= step:
                quorum_id, members = prev
                top = max(s for _, s, _ in members)
                primary = [a for _, s, a in members if s == top][self._rank % len([1 for _, s, _ in members if s == top])]
                key = f"{quorum_id}/{top + 1}/{self._rank}"
                store = self._store(primary, 5.0)
                store.add(key + "/late", 1)
                if self._dump:  # (tests: when it waits for the others)
                    os.makedirs(self._dump, exist_ok=True)
                    open(os.path.join(self._dump, f"group{group}-rank{self._rank}-late-quorum{quorum_id}"), "w").close()
                deadline = t0 + timeout_s
                while int(store.add(key + "/go", 0)) == 0 and int(store.add(key + "/passed", 0)) == 0 \
                        and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                self._asking = (store, key)
                return time.monotonic() - t0
            if self._last is None:
                return 0.0
            address, quorum_id, after, members_ = self._last
            final = self._final_of()
            grace = self.grace()
            deadline = t0 + (timeout_s if final else grace)
            store = self._store(address, 5.0 if final else 1.0 + grace)
            key = f"{quorum_id}/{after}/{self._rank}"
            arrived, looked = int(store.add(key, 1)), t0
            while arrived < len(members_) and time.monotonic() < deadline:
                time.sleep(POLL_S)
                arrived = int(store.add(key, 0))
                if final and time.monotonic() - looked > 1.0:  # the last sync: nobody waited for who is gone
                    looked = time.monotonic()
                    from distkit.ft.watch import stale_heartbeats

                    why, status = status_of()
                    if why is not None or any(r in stale_heartbeats(status) for r in members_):
                        break
            store.add(key + "/passed", 1)
            late = int(store.add(key + "/late", 0))
            if late > 0:  # groups left out of the last quorum wait to ask first
                store.add(key + "/go", 1)
                until = time.monotonic() + max(1.0, grace)
                while int(store.add(key + "/asked", 0)) < late and time.monotonic() < until:
                    time.sleep(POLL_S)
                time.sleep(ASKED_S)
        except Exception:  # noqa: BLE001 - the store's group is gone: nobody to wait for there
            self._stores = {}
        return time.monotonic() - t0

    def asked(self) -> None:
        """This rank has asked for the quorum (called right after ``start_quorum``): a group left out of the last
        quorum tells its members, who ask after it (:meth:`arrive`)."""
        if self._asking is not None:
            store, key = self._asking
            self._asking = None
            with contextlib.suppress(Exception):
                store.add(key + "/asked", 1)

    def payload(self, flat: torch.Tensor, quorum: Any, step: int) -> Optional[torch.Tensor]:
        """What this rank sends at this sync (``flat``: its tensors, concatenated; ``quorum``: this sync's torchft
        quorum; ``step``: this group's committed syncs before it), or None for the plain average (the first sync:
        the same answer on every group of the quorum, from its ``max_step``)."""
        self.was_late, self._sent = False, {}
        if quorum is None or int(quorum.max_step) < 1:
            return None
        heal = bool(quorum.heal)
        have = self.anchor is not None and self.anchor.numel() == flat.numel()
        # behind by one sync (left out of the last; a group further behind, restarted or resumed from an old
        # checkpoint, heals as with late = 'heal': its pseudo-gradient would be stale by several syncs)
        self.was_late = heal and have and int(quorum.max_step) == step + 1
        out = torch.zeros(flat.numel() + _TAIL, dtype=torch.float32)
        if have and (not heal or self.was_late):
            w = float(self._samples_of() - self.samples)
            delta = self.anchor - flat.detach().float()  # type: ignore[operator]
            torch.mul(delta, w, out=out[:-_TAIL])
            out[-_TAIL:] = torch.tensor([w, 1.0, 1.0 if self.was_late else 0.0])
            self._sent = {"delta": delta, "weight": w, "anchor": self.anchor, "late": self.was_late}
        return out

    @contextlib.contextmanager
    def participating(self) -> Iterator[None]:
        """While the exchange starts: a group that merges late takes part in the sum (torchft zeroes the tensor of
        a group it heals)."""
        if not self.was_late:
            yield
            return
        self._manager.is_participating = lambda: True
        try:
            yield
        finally:
            del self._manager.is_participating

    def committed(self, flat: torch.Tensor, quorum: Any) -> None:
        """The plain average committed (the first sync): the anchor the next pseudo-gradients start from."""
        self.anchor, self.samples, self._received = flat.detach().float().clone(), self._samples_of(), None
        self._met(quorum)

    def failed(self) -> None:
        """The sync did not commit: the anchor stays (the next sync's weight counts this period too); a heal's
        anchor is dropped with the heal."""
        self._received = None
        self._since = time.monotonic()

    def _met(self, quorum: Any) -> None:
        """A sync of ``quorum`` committed: its members meet in its store before the next one."""
        self._since = time.monotonic()
        if quorum is not None:
            self._last = (str(quorum.store_address), int(quorum.quorum_id), int(self._manager.current_step()),
                          list(quorum.replica_ids))

    def merged(self, total: torch.Tensor, healed: bool, quorum: Any) -> tuple[torch.Tensor, int, int]:
        """The sync committed with the sum ``total`` (every group's :meth:`payload`, summed): (the new model, flat
        float32; how many groups sent a pseudo-gradient; how many of those were late). ``healed``: this group
        healed at this sync (its base is the anchor the live group sent)."""
        received, self._received = self._received, None
        if healed:
            base = received[0] if received is not None else None
        else:
            base = self.anchor
        if base is None or base.numel() != total.numel() - _TAIL:
            raise DistkitError("fault_tolerance.late = 'merge': this group holds no anchor of the last sync (it "
                               "resumed from a checkpoint written without late = 'merge', or healed from a group "
                               "that ran without it): give every group the same fault_tolerance.late, or start "
                               "this group afresh (it heals)")
        weights = float(total[-_TAIL])
        new = base - total[:-_TAIL] / total[-_TAIL] if weights > 0 else base.clone()
        self._sent["base"] = base
        self.anchor, self.samples = new, self._samples_of()
        self._met(quorum)
        return new, int(round(float(total[-2]))), int(round(float(total[-1])))

    def dump(self, group: int, rank: int, step: int, members: list[int], result: torch.Tensor) -> None:
        """``DISTKIT_FT_PSEUDOGRADIENTS``: this sync's record (module docstring)."""
        if not self._dump:
            return
        os.makedirs(self._dump, exist_ok=True)
        record = {"group": group, "rank": rank, "step": step, "members": members, "result": result.clone(),
                  "contributed": "delta" in self._sent, **{k: v.clone() if torch.is_tensor(v) else v
                                                           for k, v in self._sent.items()}}
        path = os.path.join(self._dump, f"group{group}-rank{rank}-step{step}.pt")
        torch.save(record, path + ".tmp")
        os.replace(path + ".tmp", path)
