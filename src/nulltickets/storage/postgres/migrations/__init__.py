"""Numbered, forward-only migrations of the PostgreSQL schema (applied by migrate.py)."""
