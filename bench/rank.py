"""`python -m bench.rank RUN_DIR`: one rank started by a framework's own launcher (horovodrun) for
`launcher=local`. The launcher process wrote the run's resolved config to RUN_DIR/config.yaml."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one thread per rank on CPU

if __name__ == "__main__":
    from bench.run import rank_main

    sys.exit(rank_main(sys.argv[1]))
