"""A generation model (it answers with its pid) whose module starts a thread when imported.

Importing this module starts a thread, as a library's thread pool would at import: a warm spare
imports its model's module before it is taken, so that thread exists before the spare learns the
cores of the replica it is to serve (``stage_entry.pin_to_cpus`` must move it too).
"""

from __future__ import annotations

import threading
from typing import Any

_IMPORTED = threading.Event()
threading.Thread(target=_IMPORTED.wait, name="started-at-import", daemon=True).start()


def make_core_probe() -> Any:
    from tests.models import PidProbe

    return PidProbe()
