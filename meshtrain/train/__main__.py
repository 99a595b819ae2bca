"""``python -m meshtrain.train``: one worker of a run started by torchrun (see ``launch.py``)."""

import sys

from .launch import main_torchrun

sys.exit(main_torchrun())
