"""``meshtrain.worker_processes``: processes forked from a server that imported torch run under the
caller's environment *at the call*, as under spawn, down to meshtrain's import-time settings."""

from __future__ import annotations

import os
import tempfile

from meshtrain.comm.launch import spawn


def _seen(rank: int) -> tuple[str | None, int, str, int]:
    from meshtrain.comm.transport import shm_mailbox  # reads MESHTRAIN_SHM_SLOT_BYTES at import

    return os.environ.get("MESHTRAIN_SHM_SLOT_BYTES"), shm_mailbox.SLOT_BYTES, tempfile.gettempdir(), os.getpid()


def test_ranks_see_the_environment_of_the_call_not_the_servers(monkeypatch, tmp_path):
    # conftest started the server before this test: these settings did not exist then
    monkeypatch.setenv("MESHTRAIN_SHM_SLOT_BYTES", "4096")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first = spawn(2, _seen, transport="shm")
    assert [s[:3] for s in first] == [("4096", 4096, str(tmp_path))] * 2
    monkeypatch.delenv("MESHTRAIN_SHM_SLOT_BYTES")
    monkeypatch.setenv("TMPDIR", tempfile.gettempdir())
    again = spawn(2, _seen, transport="shm")
    assert [s[:2] for s in again] == [(None, 512 << 10)] * 2  # the module default: imported anew in each process
    assert len({s[3] for s in first + again} | {os.getpid()}) == 5  # four processes of their own
