"""Persistence. The layers above see only the ports (ports.py, backend.py) and open a database
through factory.py; nothing above this package imports a backend or a driver."""
