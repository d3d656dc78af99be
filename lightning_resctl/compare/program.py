"""How this process was started, as the command line's help and messages name it (read by ``lightning_resctl``'s
``__main__`` and by :mod:`.cli`; imports nothing of the package)."""
from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["program_name"]


def program_name() -> str:
    """How this process was started, as help and messages name it: ``python -m lightning_resctl`` or (the installed
    script, and the default) ``lightning-resctl``."""
    main_file = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if main_file is not None and main_file.name == "__main__.py" and main_file.parent.name == "lightning_resctl":
        return "python -m lightning_resctl"
    return "lightning-resctl"
