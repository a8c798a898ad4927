"""``python -m bench``: the same as ``specgate bench``."""

import typer

from bench.cli import bench

typer.run(bench)
