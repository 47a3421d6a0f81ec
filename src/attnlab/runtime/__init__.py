"""What every command shares about the machine it runs on: devices and dtypes this torch build can
use, output directories that can be written, files written atomically, and the one exception
class for a user's mistake. Below every other layer but ``core``'s peers: it imports no attnlab code.
"""

from .devices import DEVICE_HELP, DTYPE_HELP, cpu_info, resolve_device, resolve_dtype
from .disk import DiskFullError, append_whole, check_free_space, disk_full_line, free_bytes, nbytes, writing
from .errors import LimitError, ModelFileError, ModelFileNotFoundError, UsageError, check_range
from .files import atomic_write_bytes, atomic_write_text, check_writable_dir, missing_dirs, remove_if_empty
from .memory import (
    OutOfMemory,
    available_bytes,
    check_fits,
    gib,
    heap_trimmed_each_layer,
    memory_limit,
    out_of_memory,
    out_of_memory_line,
    release_freed_heap,
    trims_each_layer,
)
from .optional import import_advice
from .run_lock import LOCK_NAME, RunLock
from .signals import INTERRUPTS, Terminated, interrupt_exit, keep, kept

__all__ = [
    "DEVICE_HELP",
    "DTYPE_HELP",
    "cpu_info",
    "disk_full_line",
    "free_bytes",
    "INTERRUPTS",
    "DiskFullError",
    "OutOfMemory",
    "LOCK_NAME",
    "LimitError",
    "ModelFileError",
    "ModelFileNotFoundError",
    "RunLock",
    "Terminated",
    "UsageError",
    "append_whole",
    "atomic_write_bytes",
    "available_bytes",
    "atomic_write_text",
    "check_fits",
    "check_free_space",
    "check_range",
    "check_writable_dir",
    "missing_dirs",
    "remove_if_empty",
    "gib",
    "import_advice",
    "interrupt_exit",
    "keep",
    "kept",
    "memory_limit",
    "nbytes",
    "out_of_memory",
    "out_of_memory_line",
    "heap_trimmed_each_layer",
    "release_freed_heap",
    "trims_each_layer",
    "resolve_device",
    "resolve_dtype",
    "writing",
]
