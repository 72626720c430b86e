"""Persistence. Nothing above this package imports apsw."""
