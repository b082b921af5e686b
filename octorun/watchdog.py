"""Deadlines and a shared abort switch, so that no octorun process ever hangs silently.

Assumptions: every blocking wait in the runtime goes through :meth:`Watchdog.deadline` (or waits
with an explicit timeout taken from it); a process that fails calls :meth:`Watchdog.fail`, which
writes one line to stderr, sets an abort key in the rendezvous store that every process of the
job shares, and ends the process with ``os._exit``. A background thread in every process polls
that key and ends its own process (naming the failed rank and what it was itself doing) as soon
as it appears. A process killed outright cannot set the key; its peers then fail at their next
wait, either because the transport reports the closed connection or because the deadline passes.

``os._exit`` is deliberate: a stuck collective or a receive blocked in C++ cannot be unwound by
an exception, and Python's normal shutdown would join the very threads that are stuck.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["Watchdog", "gist", "ABORT_KEY", "EXIT_FAILURE", "EXIT_BAD_INPUT"]

log = logging.getLogger("octorun.watchdog")

ABORT_KEY = "octorun/abort"
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
_POLL_S = 0.25


_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def gist(exc: BaseException) -> str:
    """An exception in one short line: its type and its first sentence, without the C++ source
    location and the advice that gloo and c10d append."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = _SOURCE_LOCATION.sub("", text.splitlines()[0]).split(". ")[0][:300]
    return f"{type(exc).__name__}: {line}"


@dataclass
class Watchdog:
    """One per process. ``store`` is a ``torch.distributed.Store`` shared by the job, or None."""

    global_rank: int
    timeout_s: float
    store: Any = None
    activity: str = "starting"

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failing = False

    # -- the shared switch -------------------------------------------------------------------
    def start(self) -> None:
        if self.store is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._poll, name="octorun-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (call before the last barrier: a peer that finished may close the store)."""
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                aborted = self.store.check([ABORT_KEY])
                text = self.store.get(ABORT_KEY).decode(errors="replace") if aborted else ""
            except Exception as exc:  # the store lives with rank 0 or the launcher: losing it is fatal
                if self._stop.is_set():
                    return
                self._exit(f"lost contact with the job's rendezvous store ({type(exc).__name__}) while {self.activity}")
            else:
                if aborted and not self._stop.is_set():
                    self._exit(f"stopping because {text}; this rank was {self.activity}")

    # -- failing -----------------------------------------------------------------------------
    def doing(self, activity: str) -> None:
        """Record what this process does now; failure and abort messages quote it."""
        self.activity = activity

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def fail(self, problem: str, *, code: int = EXIT_FAILURE) -> NoReturn:
        """Tell every process of the job that this one failed, then end this one."""
        with self._lock:
            if not self._failing:
                self._failing = True
                if self.store is not None:
                    try:
                        # A peer that failed first sets the key before it exits, so a broken
                        # connection to it is a symptom: report the peer's cause, not ours.
                        if self.store.check([ABORT_KEY]):
                            cause = self.store.get(ABORT_KEY).decode(errors="replace")
                            self._exit(f"stopping because {cause}; this rank then saw: {problem}")
                        self.store.set(ABORT_KEY, f"rank {self.global_rank} failed: {problem}")
                    except Exception as exc:  # the store may be gone with a dead peer; exit all the same
                        log.debug("could not reach the rendezvous store while failing: %s", exc)
        self._exit(problem, code=code)

    def _exit(self, problem: str, *, code: int = EXIT_FAILURE) -> NoReturn:
        # The one place the runtime writes to stderr itself: these are the process's last words,
        # and logging may not be configured in a process launched by torchrun.
        sys.stderr.write(f"octorun: rank {self.global_rank}: {problem}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)
