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


@contextlib.contextmanager
def native_stderr_held(*, replay: bool = True) -> Iterator[None]:
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok and replay:
                held.seek(0)
                text = held.read()
                while text:
                    text = text[os.write(2, text):]
