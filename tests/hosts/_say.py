"""One line to the worker's stdout in one write(2), for the host workers whose lines a test parses.

The simulated hosts run with PYTHONUNBUFFERED=1, where ``print`` writes the text and its newline in
two calls: two ranks sharing a host's log could then interleave as ``...exit 0layout ...exit 0\\n\\n``
and a test reading one line per rank would miss one (the CI failure of a23f078). A single write of a
short line to the shared file is not split.
"""

import os
import sys


def say(line: str) -> None:
    """Write ``line`` and its newline to stdout as one write, after whatever stdout holds."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())
