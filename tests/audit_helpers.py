"""Helpers shared by the audit and key tests."""

from __future__ import annotations

import typer

from gateway.cli_admin import audit_app, db_app, keys_app


def admin_cli() -> typer.Typer:
    """The admin command groups mounted as ``gateway.cli`` mounts them."""
    app = typer.Typer()
    app.add_typer(db_app, name="db")
    app.add_typer(keys_app, name="keys")
    app.add_typer(audit_app, name="audit")
    return app
