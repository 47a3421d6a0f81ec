"""What every command shares about the machine it runs on: devices and dtypes this torch build can
use, output directories that can be written, files written atomically, and the one exception
class for a user's mistake. Below every other layer but ``core``'s peers: it imports no attnlab code.
"""

from .devices import DEVICE_HELP, DTYPE_HELP, cpu_info, resolve_device, resolve_dtype
from .errors import LimitError, ModelFileError, ModelFileNotFoundError, UsageError, check_range
from .files import atomic_write_bytes, atomic_write_text, check_writable_dir
from .memory import available_bytes, gib
from .optional import import_advice
from .signals import INTERRUPTS, Terminated, interrupt_exit, keep, kept

__all__ = [
    "DEVICE_HELP",
    "DTYPE_HELP",
    "cpu_info",
    "INTERRUPTS",
    "LimitError",
    "ModelFileError",
    "ModelFileNotFoundError",
    "Terminated",
    "UsageError",
    "atomic_write_bytes",
    "available_bytes",
    "atomic_write_text",
    "check_range",
    "check_writable_dir",
    "gib",
    "import_advice",
    "interrupt_exit",
    "keep",
    "kept",
    "resolve_device",
    "resolve_dtype",
]
