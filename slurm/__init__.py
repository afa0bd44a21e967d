"""slurm/ is the package `ptbench.slurm` (pyproject.toml): the sbatch scripts, shipped as package data and found
through it (ptbench.runner.slurm.script_path). This file makes it a regular package, which every install mode
maps, pip's default editable install included."""
