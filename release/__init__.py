"""Release tooling: checksums and the release manifest (release/manifest.py)."""
