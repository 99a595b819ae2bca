"""Driver for test_interrupt: ``meshtrain train`` (argv[1:]) whose save at a signal's stop takes 60 s,
so that a second SIGINT lands while every rank is still saving. Ranks as threads only: worker
processes fork from a server this patch does not reach."""

import sys
import time

from meshtrain.cli import main
from meshtrain.train import trainer

real_save = trainer.save_checkpoint


def slow_save(*args, **kwargs):
    time.sleep(60)  # the test's second SIGINT must not wait for this
    return real_save(*args, **kwargs)


trainer.save_checkpoint = slow_save  # the stop's own save (the periodic ones go through CheckpointSaver)
sys.exit(main(["train", *sys.argv[1:]]))
