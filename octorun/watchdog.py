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
- with ``record_path``, every activity (step, op, peer, what it waits for) also goes into that
  file, a ring of the last ones mapped into memory: a line costs a memory copy, and the file
  holds a process's last activity even when the process hangs and can write nothing more. A
  process that leaves rewrites it oldest first.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from octoplan.errors import where_raised

__all__ = ["Watchdog", "gist", "timed_out", "ABORT_KEY", "ABORT_CODE_KEY", "EXIT_FAILURE", "EXIT_BAD_INPUT"]

log = logging.getLogger("octorun.watchdog")

ABORT_KEY = "abort"  # under the attempt's prefix (see Watchdog.key)
# the failing process's exit status, set before ABORT_KEY: its peers exit with it, so bad input
# found once the job runs (a model folder's missing tensor, as a rank builds its stage) is exit
# 2 on every process, as bad input found before the launch is
ABORT_CODE_KEY = "abort_code"
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
_POLL_S = 0.25
_BEAT_EVERY = 2  # polls per heartbeat: two a second
_SILENT_S = 1.5  # a heartbeat that stands still this long (three beats): the peer is hung
# activities (octorun.runtime's watchdog.doing) of a process's own work, not a wait on a peer
_OWN_WORK = ("running op", "running the optimizer", "building layer", "sampling the batches", "tying the")
_GRACE_S = 2.0  # how long a leaving process waits for its host's peers to leave before killing them
_HISTORY = 24  # activities kept for the record
_LINE = 200  # bytes per line of the record file


# what gloo and c10d say when a peer's end of a connection went away
_CONNECTION_LOST = re.compile(r"connection (closed|reset|refused)|reset by peer|broken pipe|read error|socket closed",
                              re.IGNORECASE)
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a deadline of gloo's or c10d's that passed (a send, a collective): the
    failure of a wait, which names the peers that stopped responding."""
    return "timed out" in str(exc).lower()


def gist(exc: BaseException) -> str:
    """An exception in one short line: its type and its first sentence, without the C++ source
    location and the advice that gloo and c10d append, and the line of the user's code (a
    model file's) it was raised in, if any (:func:`octoplan.errors.where_raised`)."""
    text = str(exc).strip()
    line = _SOURCE_LOCATION.sub("", text.splitlines()[0]).split(". ")[0][:300] if text else ""
    return f"{type(exc).__name__}{': ' if line else ''}{line}{where_raised(exc)}"


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
        self._ring: mmap.mmap | None = None  # the record file while the process runs
        # inside watching_beats: the next process's last heartbeat seen and since when (monotonic s)
        self._beats_seen: dict[str, tuple[Any, float]] | None = None
        self._count = 0  # activities recorded so far
        # torchrun --max-restarts starts the workers again with the same store: keys of an
        # earlier attempt (its abort above all) must not reach the next one
        self.prefix = f"octorun/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.node = f"{socket.gethostname()} {os.environ.get('GROUP_RANK', '0')}"  # torchrun's node rank
        # what this process undoes where bad input ends the job (the one line says it all): an
        # output begun and still empty, a lock it took on a --save root
        self.on_bad_input: list[Callable[[], None]] = []

    def key(self, name: str) -> str:
        return self.prefix + name

    # -- the shared switch -------------------------------------------------------------------
    def register(self) -> None:
        """Tell the job where this process lives (host and pid), for the reaping of hung peers."""
        if self.store is None:
            return
        try:
            self.store.set(self.key(f"proc/{self.global_rank}"), f"{socket.gethostname()} {os.getpid()}")
            self.store.set(self.key(f"doing/{self.global_rank}"), self.activity)
            self.store.add(self.key(f"beat/{self.global_rank}"), 1)
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
            try:
                if polls % _BEAT_EVERY == 0:
                    # with the beat, what this process does: a peer past its deadline can then
                    # tell a process stuck in its own work (its beat goes on) from one waiting
                    self.store.set(self.key(f"doing/{self.global_rank}"), self.activity)
                    self.store.add(self.key(f"beat/{self.global_rank}"), 1)
                aborted = self.abort_seen()
            except Exception as exc:  # the store lives with rank 0 or the launcher: losing it is fatal
                if self._stop.is_set():
                    return
                # which peer died cannot be asked of a store that is gone: name where it lived
                self._exit(f"lost contact with the job's rendezvous store ({type(exc).__name__}) while {self.activity}: "
                           f"its host ({os.environ.get('MASTER_ADDR', 'MASTER_ADDR')}, the first node's launcher or "
                           "rank 0) is gone or unreachable")
            else:
                if aborted is not None and not self._stop.is_set():
                    text, code = aborted
                    self._exit(f"stopping because {text}; this rank was {self.activity}", code=code,
                               quiet=not self._tells_its_node(code))
                seen = self._beats_seen  # once: the main thread may end the watch meanwhile
                if seen is not None and polls % _BEAT_EVERY == 0:
                    self._check_beats(seen)

    def abort_seen(self) -> tuple[str, int] | None:
        """(what the first failing process said, its exit status) once one has failed; raises
        what the store raises."""
        if not self.store.check([self.key(ABORT_KEY)]):
            return None
        text = self.store.get(self.key(ABORT_KEY)).decode(errors="replace")
        code = EXIT_FAILURE
        if self.store.check([self.key(ABORT_CODE_KEY)]):
            with contextlib.suppress(ValueError):
                code = int(self.store.get(self.key(ABORT_CODE_KEY)).decode())
        return text, code

    @contextlib.contextmanager
    def watching_beats(self) -> Iterator[None]:
        """While inside, end the job when the next process's heartbeat stands still for
        ``timeout_s`` (every process watches the next, so every one is watched): for
        waits with a longer limit of their own (a checkpoint's save, whose collectives wait as
        long as the slowest shard takes to write), where a hung peer would otherwise hold every
        rank until that limit. A peer that is slow but alive beats on, and is waited for."""
        if self.store is None or self.world <= 1:
            yield
            return
        self._beats_seen = {}
        try:
            yield
        finally:
            self._beats_seen = None

    def _check_beats(self, seen: dict[str, tuple[Any, float]]) -> None:
        # each process watches the next one (a ring), so the store answers one read per process
        # and beat, not one per pair: a hung process is found by the one before it, whose abort
        # then ends the rest
        peer = (self.global_rank + 1) % self.world
        try:
            beat = self.store.get(self.key(f"beat/{peer}"))
        except Exception:  # a store that is gone is the poll's own finding
            return
        now = time.monotonic()
        last, since = seen.get("next", (None, now))
        if beat != last:
            seen["next"] = (beat, now)
        elif now - since >= self.timeout_s and not self._stop.is_set():
            self.fail(f"{self.activity}: global rank {peer} stopped responding (no heartbeat for "
                      f"{self.timeout_s:g} s: hung or stopped)")

    # -- failing -----------------------------------------------------------------------------
    def doing(self, activity: str) -> None:
        """Record what this process does now; failure and abort messages quote it."""
        self.activity = activity
        now = time.monotonic()
        self.history.append((now, activity))
        if self._ring is not None:
            slot = 1 + self._count % _HISTORY
            self._count += 1
            self._ring[slot * _LINE:(slot + 1) * _LINE] = _line(f"{now - self._began:10.3f}  {activity}")
            self._ring[0:_LINE] = _line(self._title(f"a ring: the newest is line {slot + 1}, `sort -n` orders it"))

    def _title(self, order: str) -> str:
        return (f"global rank {self.global_rank}, pid {os.getpid()} on {socket.gethostname()}: its last activities, "
                f"seconds since it started ({order})")

    def open_record(self) -> None:
        """Map the record file (see above); without it the run goes on, unrecorded."""
        if self.record_path is None:
            return
        try:
            with open(self.record_path, "w+b") as out:
                out.write(_line(self._title("none yet")) + _line("") * _HISTORY)
                out.flush()
                self._ring = mmap.mmap(out.fileno(), (1 + _HISTORY) * _LINE)
        except (OSError, ValueError) as exc:  # a record is a help, never a reason to fail
            log.debug("could not map %s: %s", self.record_path, exc)

    def write_record(self) -> None:
        """Rewrite the record file oldest first (a process that leaves)."""
        if self.record_path is None:
            return
        lines = [self._title("newest last")] + [f"{at - self._began:10.3f}  {what}" for at, what in list(self.history)]
        try:
            if self._ring is not None:
                self._ring.close()
                self._ring = None
            partial = Path(f"{self.record_path}.partial")
            partial.write_text("\n".join(lines) + "\n")
            os.replace(partial, self.record_path)
        except (OSError, ValueError) as exc:
            log.debug("could not write %s: %s", self.record_path, exc)

    def close_record(self, *, keep: bool) -> None:
        """The run ended well: unmap the record and remove it unless ``keep``."""
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self.record_path and not keep:
            Path(self.record_path).unlink(missing_ok=True)

    def _watch_peers(self) -> tuple[list[int], dict[int, str]]:
        """Over :data:`_SILENT_S`: the peers whose heartbeat stood still (hung or stopped), and
        those whose beat went on in one activity of their own work all the while (stuck in a
        kernel, a loop, a sleep: no heartbeat shows it), with that activity."""
        if self.store is None or self.world <= 1:
            return [], {}
        peers = [rank for rank in range(self.world) if rank != self.global_rank]
        keys = [self.key(f"{kind}/{rank}") for kind in ("beat", "doing") for rank in peers]
        try:
            before = self.store.multi_get(keys)
            time.sleep(_SILENT_S)
            after = self.store.multi_get(keys)
        except Exception:
            return [], {}
        count = len(peers)
        silent = [rank for rank, a, b in zip(peers, before[:count], after[:count]) if a == b]
        busy = {rank: b.decode(errors="replace") for rank, a, b in zip(peers, before[count:], after[count:])
                if a == b and rank not in silent and b.decode(errors="replace").startswith(_OWN_WORK)}
        return silent, busy

    def fail_on(self, what: str, exc: BaseException) -> NoReturn:
        """Fail for an exception a collective raised: a timeout names the hung peers too."""
        self.fail(f"{what}: {gist(exc)}", waited=timed_out(exc))

    def fail_waiting(self, problem: str) -> NoReturn:
        """:meth:`fail` for a deadline that passed: names the peers that stopped responding."""
        self.fail(problem, waited=True)

    def _silent_text(self) -> str:
        silent, busy = self._watch_peers()
        text = ""
        if silent:
            listed = ", ".join(map(str, silent))
            text += f"; global rank{'s' if len(silent) > 1 else ''} {listed} stopped responding (no heartbeat in " \
                    f"{_SILENT_S:g} s of watching: hung or stopped)"
        for rank, activity in busy.items():
            text += f"; global rank {rank} was {activity} all the while, waiting on no peer (stuck in its own work)"
        return text

    def _diagnosis(self, problem: str, *, waited: bool) -> str:
        """Who is to blame for a failure: a peer on this host whose process is gone (a lost
        connection is the first sign of a killed peer, seen before the kernel has quite ended
        it: look again for a moment), else, after a deadline or a lost connection, the peers
        whose heartbeat stands still (a hung peer, or one its own deadline ended)."""
        connection = bool(_CONNECTION_LOST.search(problem))
        dead = self.dead_peers(wait_s=1.0 if connection else 0.0)
        if dead:
            return dead
        return self._silent_text() if waited or connection else ""

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _peers_here(self) -> dict[int, int]:
        """global rank -> pid of the registered peers on this host."""
        host, peers = socket.gethostname(), {}
        for rank in range(self.world):
            if rank == self.global_rank or not self.store.check([self.key(f"proc/{rank}")]):
                continue
            where, pid = self.store.get(self.key(f"proc/{rank}")).decode().rsplit(" ", 1)
            if where == host:
                peers[rank] = int(pid)
        return peers

    def dead_peers(self, *, wait_s: float = 0.0) -> str:
        """Which peers on this host are gone (killed, crashed), looking for up to ``wait_s``."""
        if self.store is None:
            return ""
        try:
            peers = self._peers_here()
            deadline = time.monotonic() + wait_s
            while True:
                dead = [f"global rank {rank} (pid {pid})" for rank, pid in peers.items() if not _alive(pid)]
                if dead or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception:
            return ""
        return f"; {', '.join(dead)} {'is' if len(dead) == 1 else 'are'} gone" if dead else ""

    def fail(self, problem: str, *, code: int = EXIT_FAILURE, waited: bool = False) -> NoReturn:
        """Tell every process of the job that this one failed, then end this one (``waited``:
        a deadline passed)."""
        if code == EXIT_FAILURE:
            problem += self._diagnosis(problem, waited=waited)
        quiet = False
        with self._lock:
            if not self._failing:
                self._failing = True
                if self.store is not None:
                    try:
                        # A peer that failed first sets the key before it exits, so a broken
                        # connection to it is a symptom: report the peer's cause, not ours.
                        if self.store.check([self.key(ABORT_KEY)]):
                            cause = self.store.get(self.key(ABORT_KEY)).decode(errors="replace")
                            # its own exit status: bad input it found is bad input, whoever spoke first
                            self._exit(f"stopping because {cause}; this rank then saw: {problem}", code=code,
                                       quiet=not self._tells_its_node(code))
                        # its node hears it from this rank, unless a peer there that found the same
                        # at the same moment (a replica) spoke first
                        quiet = not self._tells_its_node(code)
                        self.store.set(self.key(ABORT_CODE_KEY), str(code))
                        self.store.set(self.key(ABORT_KEY), f"rank {self.global_rank} failed: {problem}")
                    except Exception as exc:  # the store may be gone with a dead peer; exit all the same
                        log.debug("could not reach the rendezvous store while failing: %s", exc)
        self._exit(problem, code=code, quiet=quiet)

    def _tells_its_node(self, code: int) -> bool:
        """Whether this process is to say why the job stops, on its node. Bad input is said once
        a node, as before the launch (octorun.cli): by the rank that found it, and on each other
        node by the first process to hear of it; a failure's every process says what it was
        doing, which is how a hang or a crash is traced."""
        if code != EXIT_BAD_INPUT or self.store is None:
            return True
        try:
            return int(self.store.add(self.key(f"told/{self.node}"), 1)) == 1
        except Exception:  # a store that is gone: better twice than never
            return True

    def _exit(self, problem: str, *, code: int = EXIT_FAILURE, quiet: bool = False) -> NoReturn:
        """End this process with ``code``, saying ``problem`` on stderr unless ``quiet`` (its node
        has heard the reason from another process). A failure's record keeps the problem; bad
        input leaves no record, and undoes what :attr:`on_bad_input` lists."""
        if not self._leaving.acquire(blocking=False):  # the other thread is leaving already: let it
            while True:
                time.sleep(3600)
        self._stop.set()
        # The one place the runtime writes to stderr itself: these are the process's last words,
        # and logging may not be configured in a process launched by torchrun.
        if not quiet:
            sys.stderr.write(f"octorun: rank {self.global_rank}: {problem}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        self.doing(f"leaving: {problem}")
        if code == EXIT_BAD_INPUT:  # bad input leaves nothing behind: no record, nothing begun
            self.close_record(keep=False)
            for undo in self.on_bad_input:
                with contextlib.suppress(Exception):
                    undo()
        else:
            self.write_record()
        self._reap_hung_peers()
        os._exit(code)

    def _reap_hung_peers(self) -> None:
        """Mark this process gone; SIGKILL the peers on this host that are not gone after the grace."""
        if self.store is None:
            return
        try:
            self.store.set(self.key(f"gone/{self.global_rank}"), "1")
            peers = self._peers_here()
            deadline = time.monotonic() + _GRACE_S
            while peers and time.monotonic() < deadline:
                peers = {rank: pid for rank, pid in peers.items()
                         if _alive(pid) and not self.store.check([self.key(f"gone/{rank}")])}
                if peers:
                    time.sleep(_POLL_S)
            for rank, pid in peers.items():
                if not _alive(pid) or self.store.add(self.key(f"reaped/{rank}"), 1) != 1:  # one reaper says it
                    continue
                # a process that left between the liveness check and the kill has nothing to reap
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    sys.stderr.write(f"octorun: rank {self.global_rank}: killed global rank {rank} (pid {pid}), "
                                     f"which did not leave within {_GRACE_S:g} s of the job's failure\n")
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


def _line(text: str) -> bytes:
    """One fixed-width line of the record file."""
    data = text.encode("utf-8", errors="replace")[: _LINE - 1]
    return data + b" " * (_LINE - 1 - len(data)) + b"\n"
