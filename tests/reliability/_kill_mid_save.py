"""Driver for test_kill_mid_save: run ``meshtrain train`` in this process and SIGKILL the process
at a chosen point of the save of step 4 (argv[1]); the remaining arguments go to ``meshtrain train``.

Points: ``shard`` (half of a shard file written), ``metadata`` (metadata.json written, the step
directory not yet renamed), ``latest`` (renamed, ``latest`` not yet replaced).
"""

import os
import signal
import sys

from meshtrain.cli import main
from meshtrain.train import checkpoint, checkpoint_io

POINT, TARGET = sys.argv[1], "step-00000004"
real_write, real_replace = checkpoint_io.write_durable, checkpoint_io.replace_durable
real_stream = checkpoint_io.write_durable_stream


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def write_durable(path: str, data: bytes) -> None:
    if TARGET in path and POINT == "shard" and path.endswith(".safetensors"):
        with open(path, "wb") as f:  # the writer dies halfway through its shard
            f.write(data[: len(data) // 2])
            f.flush()
        _die()
    real_write(path, data)
    if TARGET in path and POINT == "metadata" and path.endswith(checkpoint_io.METADATA):
        _die()


def write_durable_stream(path, chunks, size):
    if TARGET in path and POINT == "shard" and path.endswith(".safetensors"):
        with open(path, "wb") as f:  # the writer dies halfway through its shard (streamed in pieces)
            written = 0
            for data in chunks:
                data = bytes(data)[: max(0, size // 2 - written)]
                f.write(data)
                written += len(data)
            f.flush()
        _die()
    return real_stream(path, chunks, size)


def replace_durable(path: str, data: bytes) -> None:
    if POINT == "latest" and path.endswith(checkpoint_io.LATEST) and TARGET in data.decode():
        _die()
    real_replace(path, data)


checkpoint_io.write_durable = checkpoint.write_durable = write_durable
checkpoint_io.replace_durable = checkpoint.replace_durable = replace_durable
checkpoint_io.write_durable_stream = write_durable_stream
sys.exit(main(["train", *sys.argv[2:]]))
