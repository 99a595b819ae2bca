"""torchrun's worker for test_elastic_hosts: ``python -m meshtrain.train``'s, with each step slowed by
``MESHTRAIN_TEST_STEP_DELAY`` seconds in a world of ``MESHTRAIN_TEST_DELAY_WORLD`` ranks only, so a
host started again joins before the smaller world has finished the run, however fast this machine."""

import os
import sys
import time

from meshtrain.train import trainer
from meshtrain.train.launch import main_torchrun

if __name__ == "__main__":
    delay = float(os.environ.get("MESHTRAIN_TEST_STEP_DELAY", "0"))
    if delay and os.environ.get("WORLD_SIZE") == os.environ.get("MESHTRAIN_TEST_DELAY_WORLD"):
        step = trainer.measure_step

        def slow_step(*args, **kwargs):
            time.sleep(delay)
            return step(*args, **kwargs)

        trainer.measure_step = slow_step
    sys.exit(main_torchrun())
