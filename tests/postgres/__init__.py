"""Tests against a real PostgreSQL that the session starts (tests/pgserver.py)."""
