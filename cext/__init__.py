"""The claim/transition core, kept in Cython's pure-Python mode: `core.py` runs as it is, or
compiled by Cython into an extension module of the same name when the package is built with a
C compiler. `nulltickets.core` picks whichever is there (NULLTICKETS_PURE_PYTHON=1 forces the
interpreted one)."""
