"""`python -m ptbench.scale`: a dry run of one rank of W on torch's fake process group (bench/README.md "At scale").

run.py (the plan at W, the rank's own setup and 2 steps), standins.py (the fake world and what stands in for what it
lacks), measure.py (collective ledger, memory tracker), compare.py (beside the comm formula and memory model),
point.py (one point assembled), matrix.py (every adapter x workload x W: `make scale`), __main__.py (the command
and its record).
"""
