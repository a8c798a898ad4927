"""Alembic migrations for Specgate's database; applied with ``specgate db upgrade``."""
