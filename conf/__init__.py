"""conf/ is the package `ptbench.conf` (pyproject.toml): Hydra's config folder, shipped as package data. This file
makes it a regular package, which every install mode maps, pip's default editable install included."""
