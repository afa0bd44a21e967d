"""`python -m ptbench.compare BASELINE NEW`: did anything get slower or bigger, and can it be trusted?

BASELINE and NEW are results folders, or BASELINE a file `--save-baseline` wrote. Points are matched by what
they measure, not by run id; per point and metric the ratio NEW/BASELINE with its 95 % interval and a verdict
(ptbench.analysis.compare states the rule). Writes compare.md, compare.csv and compare.png/.svg into --out
(default NEW/compare). Exit 0: no regression decided; 1: one or more (--strict: or an undecided point); 2: bad
input, in one line. The last line reads `compare: N points, R regressions, I improvements, S same, U undecided`.

    python -m ptbench.compare --save-baseline ci/baseline.json results/smoke   # a baseline for a repository
    python -m ptbench.compare ci/baseline.json results/smoke --strict
    python -m ptbench.compare results/nccl-2.21 results/nccl-2.23 --vary adapter.bucket_cap_mb
    python -m ptbench.compare --error-rates                                    # its simulated error rates
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    # the statistics are the analysis package's, which reads records only (drivers do not import it): it runs
    # as its own process, whose output and exit status are this command's
    args = sys.argv[1:] if argv is None else argv
    return subprocess.run([sys.executable, "-m", "ptbench.analysis.compare", *args]).returncode


if __name__ == "__main__":
    sys.exit(main())
