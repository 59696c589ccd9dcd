"""Files written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary_path)`` and rename the result to ``path`` (same folder, atomic):
    a failure leaves ``path`` as it was and no temporary file behind."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temporary))
        os.chmod(temporary, 0o644)  # mkstemp creates owner-only files; these are for everyone
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
