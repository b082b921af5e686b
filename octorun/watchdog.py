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

A hung peer (stopped, or stuck in a kernel) cannot read the abort key and would keep its
launcher waiting (torchrun gives a worker 30 s between SIGTERM and SIGKILL). So:
- every process registers its host and pid in the store and beats a heartbeat counter there
  from its watchdog thread; a process failing on a deadline names the peers whose heartbeat
  stood still (the hung ones), not only the peer it happened to wait for;
- every process leaving because the job failed marks itself gone, then, for a short grace, waits
  for its peers on the same host to do the same, and SIGKILLs those that do not: a live process
  leaves within one poll of the abort key, so only a hung one is killed. A host whose every
  process hangs is left to its launcher.
- with ``record_path``, the watchdog thread keeps a short record of this process's last
  activities (step, op, peer, what it waits for) in that file, rewritten as they change, so that
  the record of a process that hangs is on disk too.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["Watchdog", "gist", "ABORT_KEY", "EXIT_FAILURE", "EXIT_BAD_INPUT"]

log = logging.getLogger("octorun.watchdog")

ABORT_KEY = "octorun/abort"
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
_POLL_S = 0.25
_BEAT_EVERY = 4  # polls per heartbeat: one a second
_SILENT_S = 2.5  # a heartbeat that stands still this long: the peer is hung
_GRACE_S = 3.0  # how long a leaving process waits for its host's peers to leave before killing them
_HISTORY = 24  # activities kept for the record


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
    world: int = 1
    record_path: str | None = None  # the file of this process's last activities (see above)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failing = False
        self._leaving = threading.Lock()
        self._began = time.monotonic()
        self.history: collections.deque[tuple[float, str]] = collections.deque(maxlen=_HISTORY)
        self._written = None  # the last activity the record file holds

    # -- the shared switch -------------------------------------------------------------------
    def register(self) -> None:
        """Tell the job where this process lives (host and pid), for the reaping of hung peers."""
        if self.store is None:
            return
        try:
            self.store.set(f"octorun/proc/{self.global_rank}", f"{socket.gethostname()} {os.getpid()}")
            self.store.add(f"octorun/beat/{self.global_rank}", 1)
        except Exception as exc:  # without it a hung peer is left to the launcher, as before
            log.debug("could not register with the store: %s", exc)

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
        polls = 0
        while not self._stop.wait(_POLL_S):
            polls += 1
            self.write_record()
            try:
                if polls % _BEAT_EVERY == 0:
                    self.store.add(f"octorun/beat/{self.global_rank}", 1)
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
        self.history.append((time.monotonic(), activity))

    def write_record(self) -> None:
        """Rewrite the record file when the activity changed since the last write."""
        if self.record_path is None or not self.history or self.history[-1] is self._written:
            return
        latest = self.history[-1]
        now = time.monotonic()
        lines = [f"global rank {self.global_rank}, pid {os.getpid()} on {socket.gethostname()}: its last activities, "
                 f"seconds since it started (newest last; written {now - self._began:.1f} s in)"]
        lines += [f"{at - self._began:10.3f}  {what}" for at, what in list(self.history)]
        try:
            partial = Path(f"{self.record_path}.partial")
            partial.write_text("\n".join(lines) + "\n")
            os.replace(partial, self.record_path)
            self._written = latest
        except OSError as exc:  # a record is a help, never a reason to fail
            log.debug("could not write %s: %s", self.record_path, exc)

    def silent_peers(self) -> list[int]:
        """The global ranks whose heartbeat stands still for :data:`_SILENT_S` (hung ones)."""
        if self.store is None or self.world <= 1:
            return []
        keys = [f"octorun/beat/{rank}" for rank in range(self.world)]
        try:
            before = self.store.multi_get(keys)
            time.sleep(_SILENT_S)
            after = self.store.multi_get(keys)
        except Exception:
            return []
        return [rank for rank, (a, b) in enumerate(zip(before, after)) if a == b and rank != self.global_rank]

    def fail_on(self, what: str, exc: BaseException) -> NoReturn:
        """Fail for an exception a collective raised: a timeout names the hung peers too."""
        problem = f"{what}: {gist(exc)}"
        if "timed out" in str(exc).lower():
            self.fail_waiting(problem)
        self.fail(problem)

    def fail_waiting(self, problem: str) -> NoReturn:
        """:meth:`fail` for a deadline that passed: names the peers that stopped responding."""
        silent = self.silent_peers()
        if silent:
            listed = ", ".join(map(str, silent))
            problem += f"; global rank{'s' if len(silent) > 1 else ''} {listed} stopped responding (no heartbeat for " \
                       f"{_SILENT_S:g} s: hung or stopped)"
        self.fail(problem)

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
        if not self._leaving.acquire(blocking=False):  # the other thread is leaving already: let it
            while True:
                time.sleep(3600)
        self._stop.set()
        # The one place the runtime writes to stderr itself: these are the process's last words,
        # and logging may not be configured in a process launched by torchrun.
        sys.stderr.write(f"octorun: rank {self.global_rank}: {problem}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        self.doing(f"leaving: {problem}")
        self.write_record()
        self._reap_hung_peers()
        os._exit(code)

    def _reap_hung_peers(self) -> None:
        """Mark this process gone; SIGKILL the peers on this host that are not gone after the grace."""
        if self.store is None:
            return
        try:
            self.store.set(f"octorun/gone/{self.global_rank}", "1")
            host = socket.gethostname()
            peers = {}
            for rank in range(self.world):
                if rank == self.global_rank or not self.store.check([f"octorun/proc/{rank}"]):
                    continue
                where, pid = self.store.get(f"octorun/proc/{rank}").decode().rsplit(" ", 1)
                if where == host:
                    peers[rank] = int(pid)
            deadline = time.monotonic() + _GRACE_S
            while peers and time.monotonic() < deadline:
                peers = {rank: pid for rank, pid in peers.items()
                         if _alive(pid) and not self.store.check([f"octorun/gone/{rank}"])}
                if peers:
                    time.sleep(_POLL_S)
            for rank, pid in peers.items():
                if not _alive(pid) or self.store.add(f"octorun/reaped/{rank}", 1) != 1:  # one reaper says it
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                    sys.stderr.write(f"octorun: rank {self.global_rank}: killed global rank {rank} (pid {pid}), "
                                     f"which did not leave within {_GRACE_S:g} s of the job's failure\n")
                except ProcessLookupError:
                    pass
        except Exception as exc:  # the store may be gone with its host; leave all the same
            log.debug("could not reap hung peers: %s", exc)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (or is stopped): not gone, and not a zombie its parent has yet to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return not Path("/proc").is_dir()  # no /proc: trust the signal; with /proc, the pid is gone
