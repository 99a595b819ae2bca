"""torchrun's worker for test_training_across_hosts: ``python -m meshtrain.train``'s entry point
(``launch.main_torchrun``) run once per layout, each in a process of its own, in one launch of the
simulated hosts.

Arguments: ``NAME ARGS... [--then NAME ARGS...]...``, one phase per layout, ``ARGS`` being what
``python -m meshtrain.train`` would get. This process imports the trainer once (torch and
torch._dynamo with it: the imports of 2 agents and 4 workers cost more than a layout's whole run
on 2 cores), then forks one child per phase, which calls ``main_torchrun(ARGS)`` and exits with
its code as ``python -m meshtrain.train`` would (a raised exception: its traceback and exit 1). Every child is a new
start on the agent's store: ``comm.init`` keys it by a new elastic round, as it does torchrun's
restarts, so no phase reads another's keys. Torch is made to be forked after its import
(meshtrain.worker_processes forks every spawned rank so).

Prints ``layout NAME: rank R exit CODE`` per phase and goes on to the next after a failure (the
other ranks' phases end at the comm timeout). Exits 0 once every phase has run, whatever their
codes: the test judges each layout by those lines (every rank's, each 0), and a worker that exited
non-zero would make its agent kill its sibling before that one had printed its last line.
"""

import os
import sys

import torch._dynamo  # noqa: F401 - every rank imports it (torch's optimizers do): once, before the forks
import meshtrain.train.trainer  # noqa: F401 - what main_torchrun imports when it runs
from meshtrain.train.launch import main_torchrun

from _say import say  # this script's folder is on sys.path

if __name__ == "__main__":
    phases: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        phases.append([]) if arg == "--then" else phases[-1].append(arg)
    for name, *args in phases:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the phase's run, its exit as the interpreter's (atexit, flushed streams)
            sys.exit(main_torchrun(args))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        say(f"layout {name}: rank {os.environ['RANK']} exit {code}")
