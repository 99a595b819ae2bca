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


def _env_of(*names: str) -> tuple:
    return tuple(os.environ.get(n) for n in names) + (tempfile.gettempdir(),)


def test_a_launcher_forking_from_the_server_runs_the_target_under_the_callers_env_and_its_own(monkeypatch, tmp_path):
    """torch's elastic agent (meshtrain train's launcher) forks its workers from the server and
    sets RANK etc. in each before calling the target: with_caller_env puts the caller's environment
    at the call back under those, so a setting made after the server started reaches the worker,
    one removed since does not, and the agent's own stay."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from meshtrain import worker_processes

    worker_processes.ensure_server()
    monkeypatch.setenv("MESHTRAIN_CALLER_MARK", "caller")  # did not exist when conftest started the server
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("HOME", raising=False)  # the server has it
    entry = worker_processes.with_caller_env(os.environ, _env_of)
    ctx = start_processes(name="t", entrypoint=entry, args={0: ("MESHTRAIN_CALLER_MARK", "RANK", "HOME")},
                          envs={0: {"RANK": "7"}}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
                          start_method="forkserver")
    result = ctx.wait(60)
    assert result is not None and not result.failures, result
    assert result.return_values[0] == ("caller", "7", None, str(tmp_path))
