"""Files the package writes: whole or not at all, with the mode a plain ``open()`` gives."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, cast


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that an interrupted run never leaves a truncated file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        # mkstemp creates 0600; a report is an artifact others read (CI uploads, teammates),
        # so give it the mode a plain open() would have: 0666 less the umask.
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def current_umask() -> int:
    """The process umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


class PlainData:
    """Base of the frozen dataclasses that go into reports and JSON: ``to_dict`` gives their
    fields as plain data (nested dataclasses, lists and tuples included)."""

    def to_dict(self) -> dict[str, Any]:
        # cast: asdict takes dataclass instances, which a mixin cannot say it is.
        return dataclasses.asdict(cast(Any, self))
