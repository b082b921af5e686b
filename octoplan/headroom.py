"""How much memory a process may still take on a device, and whether an exception says it ran out.

The profiler builds a whole model on one device. On a GPU, running out raises
``torch.OutOfMemoryError``; on a CPU, Linux lets allocations succeed until the kernel's OOM killer
ends the process with SIGKILL, which leaves the user no message at all. So on a CPU the profiler
watches what is left (:func:`bytes_left`) after each layer it builds, and builds each layer under
a limit on the process's private writable memory of what it holds plus what is left
(:func:`memory_capped`, RLIMIT_DATA): a layer too large for the machine then fails to
allocate, which says so, where touching its pages would have woken the killer. RLIMIT_DATA,
not the whole address space: files a model maps (np.memmap, safetensors) and address space
reserved but never written (CUDA's, malloc's arenas) do not count against it.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import Iterator

import torch

try:
    import resource
except ImportError:  # not on Linux or macOS: no limit, the checks after each layer still run
    resource = None  # type: ignore[assignment]

__all__ = ["bytes_left", "out_of_memory", "memory_capped", "SHRINK_FIX"]

# What to do when a model does not fit the device it is profiled on: its layers' times stand for
# the same layers in a larger model, so a copy with fewer layers measures the same things
SHRINK_FIX = ("profile a shrunken copy on this device: fewer layers (an hf: folder takes --config layers=N) or a "
              "smaller --microbatch-size; a few layers' profile stands for the rest of the same kind")

_CGROUP = Path("/sys/fs/cgroup")


def bytes_left(device: torch.device) -> int | None:
    """Bytes this process may still allocate on ``device``: the GPU's free memory, or on a CPU
    the least of the kernel's MemAvailable and what the process's cgroup (a container's limit)
    allows; None where neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        return None
    found = [left for left in (_proc_bytes("/proc/meminfo", "MemAvailable"), *_cgroup_left()) if left is not None]
    return min(found) if found else None


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes; None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_left() -> list[int]:
    """What the memory cgroups of this process (a container's limit) still allow: cgroup v2's
    memory.max less memory.current, or v1's memory.limit_in_bytes less usage_in_bytes, for the
    process's group and every group above it."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, group = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2
            base, limit_file, used_file = _CGROUP, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base, limit_file, used_file = _CGROUP / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / group.strip().lstrip("/")
        while True:
            with contextlib.suppress(OSError, ValueError):
                limit = (folder / limit_file).read_text().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as a huge number
                    used = int((folder / used_file).read_text().strip())
                    out.append(int(limit) - used + _reclaimable(folder))
            if folder == base:
                break
            folder = folder.parent
    return out


def _reclaimable(folder: Path) -> int:
    """The page cache a memory cgroup's usage counts that the kernel would drop before killing:
    its inactive file pages (memory.stat's inactive_file, v1's total_inactive_file)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    return 0


@contextlib.contextmanager
def memory_capped(device: torch.device) -> Iterator[None]:
    """On a CPU, the process's private writable memory (RLIMIT_DATA) limited to what it holds
    plus what is left, for the duration, and put back after: an allocation beyond it fails
    (torch raises, Python raises MemoryError) instead of succeeding until the OOM killer ends
    the process. Not where the limit cannot be set or read, nor for a GPU's build."""
    left = bytes_left(device) if device.type == "cpu" and resource is not None else None
    held = _proc_bytes("/proc/self/status", "VmData") if left is not None else None  # what RLIMIT_DATA counts
    if left is None or held is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = held + max(left, 0)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:  # a tighter limit is set already
        yield
        return
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))



def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device or the host running out of memory (torch's CUDA error, Python's
    MemoryError, or the CPU allocator's refusal of a size beyond what the kernel will map)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:  # mmap, numpy's allocations
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))
