"""The ``meshtrain bench comm`` command: tables, JSON, plot, and clear errors for bad input."""

import json
import subprocess
import sys
import traceback

import pytest

from meshtrain.cli import main


def test_bench_comm_local_writes_checked_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    rc = main(["bench", "comm", "--transport", "local", "--world", "3", "--algorithms", "ring,tree",
               "--sizes", "1K,64K", "--iters", "2", "--warmup", "1", "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "#       size         count      type   redop" in out and "algorithm=ring" in out
    recs = json.loads(js.read_text())["records"]
    assert {(r["algorithm"], r["size"]) for r in recs} == {(a, s) for a in ("ring", "tree") for s in (1024, 65536)}
    for r in recs:
        assert r["wrong"] == 0 and r["time_us"] > 0
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * 2 / 3)  # all-reduce factor 2(n-1)/n
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"])
def test_bench_comm_other_ops_check_results(op, tmp_path):
    js = tmp_path / "o.json"
    algos = "direct" if op == "all_to_all" else "direct,ring"
    assert main(["bench", "comm", "--transport", "local", "--world", "2", "--op", op, "--algorithms", algos,
                 "--sizes", "4K", "--iters", "1", "--warmup", "0", "--json", str(js)]) == 0
    assert all(r["wrong"] == 0 for r in json.loads(js.read_text())["records"])


@pytest.mark.parametrize("args, needle", [
    (["--transport", "carrier-pigeon"], "unknown transport"),
    (["--algorithms", "ring,bogus"], "unknown algorithm"),
    (["--sizes", "64M:1K"], "bad size range"),
    (["--world", "two"], "--world"),
    (["--op", "all_gather", "--algorithms", "shm_symmetric"], "shm_symmetric runs all_reduce only"),
    (["--hosts", "0"], "--hosts must be a whole number of simulated hosts >= 1"),
    (["--hosts", "two"], "--hosts: invalid int value"),
    (["--hosts", "1", "--world", "1"], "at least 2 ranks"),
    (["--hosts", "2", "--algorithms", "shm"], "cannot run all_reduce across hosts"),
    (["--hosts", "2", "--op", "all_gather", "--algorithms", "halving_doubling"], "cannot run all_gather across hosts"),
    (["--hosts", "2", "--transport", "shm"], "--transport does not apply with --hosts"),
    (["--hosts", "2", "--op", "broadcast"], "--hosts times all_reduce, all_gather, reduce_scatter"),
])
def test_bench_comm_bad_input_exits_nonzero_with_message(args, needle, tmp_path, capfd):
    # In this process, as `python -m meshtrain.cli` would end (its __main__ is sys.exit(main())): a
    # fresh interpreter per case cost 3-4 s of imports, twelve times, and the exit status, stderr
    # and files are the same (test_bench_comm_bad_input_in_a_process_of_its_own runs one as a process)
    js = tmp_path / "never.json"
    returncode, stderr = _exit_as_a_process(["bench", "comm", *args, "--json", str(js)], capfd)
    assert returncode != 0
    assert needle in stderr
    assert not js.exists()  # no partial output


def _exit_as_a_process(argv: list[str], capfd) -> tuple[int, str]:
    """``sys.exit(main(argv))`` as the interpreter ends it: the exit status (SystemExit's code, 1 with
    the traceback on stderr for any other exception) and everything written to stderr (fd 2)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except Exception:  # noqa: BLE001 - what the interpreter would do with it
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stderr.flush()
    return code or 0, capfd.readouterr().err


def test_bench_comm_bad_input_in_a_process_of_its_own(tmp_path):
    js = tmp_path / "never.json"
    proc = subprocess.run([sys.executable, "-m", "meshtrain.cli", "bench", "comm", "--transport", "carrier-pigeon",
                           "--json", str(js)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "unknown transport" in proc.stderr
    assert not js.exists()  # no partial output
