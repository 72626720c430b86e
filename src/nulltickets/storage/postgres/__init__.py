"""The PostgreSQL storage: its schema (migrations/), its named queries and their runner."""
