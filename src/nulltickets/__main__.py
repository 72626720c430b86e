"""`python -m nulltickets`: the same entry point as the `nulltickets` command."""

import multiprocessing

from nulltickets.cli import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    raise SystemExit(main())
