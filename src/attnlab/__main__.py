"""``python -m attnlab``: the package's ``__init__`` has guarded the stop signals while it imported
(``attnlab_launch.guard_start``); the CLI's imports are guarded too, then the CLI installs its own handlers."""

import sys

import attnlab
from attnlab_launch import end_guard, guard_start

usual = getattr(attnlab, "_start_guard", None) or guard_start()
try:
    from .cli import main
finally:
    end_guard(usual)

sys.exit(main())
