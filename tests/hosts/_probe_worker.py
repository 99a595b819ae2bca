"""A torch-free worker for test_simhosts: ``probe DIR`` records what this rank sees of its host and
leaves a file in /dev/shm on purpose; ``sleep`` waits to be killed."""

import json
import os
import socket
import sys
import time

if __name__ == "__main__":
    mode, rank = sys.argv[1], os.environ["RANK"]
    if mode == "probe":
        seen = {"hostname": socket.gethostname(), "group_rank": int(os.environ["GROUP_RANK"]),
                "master_addr": os.environ["MASTER_ADDR"], "shm": sorted(os.listdir("/dev/shm"))}
        with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
        open(f"/dev/shm/left-by-rank{rank}", "w").close()  # shm_left must report it
    else:
        time.sleep(300)
