"""How much memory a process may still take on a device, and whether an exception says it ran out.

The profiler builds a whole model on one device. On a GPU, running out raises
``torch.OutOfMemoryError``; on a CPU, Linux lets allocations succeed until the kernel's OOM killer
ends the process with SIGKILL, which leaves the user no message at all. So on a CPU the profiler
watches what is left (:func:`bytes_left`) as it builds, and stops with a line of its own before the
killer would.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["bytes_left", "out_of_memory", "SHRINK_FIX"]

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
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: the limit of the group this process is in, less what the group holds
        group = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1]
        folder = _CGROUP / group.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((folder / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device or the host running out of memory (torch's CUDA error, Python's
    MemoryError, or the CPU allocator's refusal of a size beyond what the kernel will map)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))
