"""Holding back what native code writes to stderr while a step that may fail runs.

c10d's C++ side logs straight to file descriptor 2: a process whose peers never come prints
two error lines and a C++ stack per connection attempt before octorun's own line, which already
names the cause (the exception's message). Held in a file while the group forms, those lines
are dropped when the step fails, and written out as they were when it ends well (a warning of
a group that did form is still seen) unless the caller knows they can only be noise: a store
client's connection retries say nothing once it has connected."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator


# the real stderr's descriptor, saved by each hold in effect (outermost first)
_saved: list[int] = []


def restore_stderr() -> None:
    """Give file descriptor 2 back to the real stderr where a hold still has it. A Ctrl-C that
    lands while a hold unwinds (c10d's connection retries end in an error, and the interrupt is
    raised at the first Python line after them) leaves the hold's file in its place, and the
    line that says the run was interrupted would go there."""
    if _saved:
        os.dup2(_saved[0], 2)


@contextlib.contextmanager
def native_stderr_held(*, replay: bool = True) -> Iterator[None]:
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    sys.stderr.flush()
    _saved.append(saved)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            try:
                sys.stderr.flush()
            finally:  # even where an interrupt is raised in the flush
                os.dup2(saved, 2)
                _saved.remove(saved)
                os.close(saved)
            if ok and replay:
                held.seek(0)
                text = held.read()
                while text:
                    text = text[os.write(2, text):]
