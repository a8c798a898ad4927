"""The ``specgate`` command. Each group lives in the module that owns it; heavy imports
(torch, the web stack) happen inside the commands so that ``specgate --help`` stays fast."""

from __future__ import annotations

import typer

from bench.cli import bench
from engine.cli import generate, models_app
from engine.training.heads.cli import heads_app
from gateway.cli_admin import audit_app, db_app, keys_app
from gateway.cli_privacy import compliance_app, privacy_app
from gateway.cli_serve import serve
from gateway.cli_teams import teams_app
from gateway.tune.cli import tune_app

app = typer.Typer(
    help="Specgate: an audited, speculative-decoding LLM gateway.", no_args_is_help=True
)
app.command()(generate)
app.command()(serve)
app.command()(bench)
app.add_typer(models_app, name="models", help="Build and inspect model checkpoints.")
app.add_typer(heads_app, name="heads", help="Train draft heads (Medusa) on a target.")
app.add_typer(db_app, name="db", help="Database migrations.")
app.add_typer(keys_app, name="keys", help="API keys and roles.")
app.add_typer(teams_app, name="teams", help="Teams and their quotas.")
app.add_typer(audit_app, name="audit", help="Audit log verification.")
app.add_typer(privacy_app, name="privacy", help="Erasure, legal holds, retention, the KEK.")
app.add_typer(compliance_app, name="compliance", help="Reports for the records of processing.")
app.add_typer(tune_app, name="tune", help="Measure and recommend speculation on own traffic.")
