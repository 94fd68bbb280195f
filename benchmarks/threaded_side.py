"""Side A of an interleaved measurement as a framework's whole loop, run in a thread and paused between steps.

A framework that owns its loop (Lightning's ``Trainer.fit``, ``transformers.Trainer.train``) cannot be stepped from
outside, so two of them cannot alternate in one thread as two hand-written loops do (``interleaved.py``). Here side A's
loop runs in a thread of its own and side B's in the main thread; a callback at the start of each of A's steps
(:meth:`ThreadedLoop.before_step`) hands control back to the main thread whenever A has taken the steps it was
granted, so exactly one of the two loops runs at any time. Side B's callback drives :class:`interleaved.Alternator`,
which grants A a block of steps (:meth:`ThreadedLoop.run_block`) and waits until A stands before its next step: A's
block time is measured from that grant to A's return, one hand-over each way per block (two thread wake-ups, tens of
microseconds against a block of 10 steps: what the A/A run, with a second copy of A in the main thread, shows).

Cross-rank contract: every rank makes the same grants at the same steps of B, so the collectives of the two loops
(their set-up, each step's all-reduce, their ends) come in the same order on every rank. A's set-up runs in
:meth:`ThreadedLoop.start`, before B's loop begins; A's loop must end by itself after the steps it is granted
(``max_steps``), its end (a barrier, its last collectives) inside the last grant.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional


class ThreadedLoop:
    """``loop(before_step)`` (a framework's ``fit``/``train``, with ``before_step`` called at the start of every
    step by a callback of that framework) run in a daemon thread, paused before every step it has not been granted."""

    def __init__(self, loop: Callable[[Callable[[], None]], Any], name: str = "side-a") -> None:
        self._loop = loop
        self._go = threading.Semaphore(0)    # main -> A: take the granted steps
        self._back = threading.Semaphore(0)  # A -> main: standing before an ungranted step, or the loop has ended
        self._granted = 0
        self.steps = 0                       # steps A has begun
        self.ended = False
        self.result: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self.result = self._loop(self.before_step)
        except BaseException as error:  # (re-raised in the main thread by the grant that was running)
            self._error = error
        finally:
            self.ended = True
            self._back.release()

    def before_step(self) -> None:
        """(A's thread, at the start of each of its steps) Go on if a step is granted, else wait for a grant."""
        if self._granted == 0:
            self._back.release()
            self._go.acquire()
        self._granted -= 1
        self.steps += 1

    def _wait(self) -> None:
        self._back.acquire()
        if self._error is not None:
            raise RuntimeError(f"side A's loop failed after {self.steps} steps: {self._error!r}") from self._error

    def start(self) -> None:
        """Run A's set-up (its collectives included) up to the start of its first step."""
        self._thread.start()
        self._wait()
        if self.ended:
            raise RuntimeError("side A's loop ended before its first step")

    def run_block(self, steps: int) -> None:
        """Let A take its next ``steps`` steps; return when it stands before the one after them, or has ended."""
        if self.ended:
            raise RuntimeError(f"side A's loop ended after {self.steps} steps, {steps} more were granted")
        self._granted = steps
        self._go.release()
        self._wait()

    def join(self) -> Any:
        """After the last grant: A's loop has ended (it must, by its own step limit); its return value."""
        self._thread.join()
        if not self.ended:
            raise RuntimeError("side A's loop has not ended")
        return self.result
