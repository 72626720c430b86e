"""The compiled parts: Cython turns cext/core.py into the extension `nulltickets._cext.core`
when the build has Cython and a C compiler, and on POSIX systems cext/walsync.c (the WAL sync
threads of durability `full`) becomes `nulltickets._cext.walsync`. Without a compiler the
package installs with the interpreted core (the same source) and a Python sync thread, so
`pip install` works everywhere. Everything else about the package is in pyproject.toml."""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install: the interpreted core is there."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all
            print(f"nulltickets: compiled core not built ({exc}); using the Python one",
                  file=sys.stderr)  # fmt: skip

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"nulltickets: compiled core not built ({exc}); using the Python one",
                  file=sys.stderr)  # fmt: skip


def extensions() -> list[Extension]:
    if os.environ.get("NULLTICKETS_PURE_PYTHON_BUILD"):
        return []
    built = []
    if os.name == "posix":  # POSIX threads (in libpthread before glibc 2.34: -pthread links it)
        flags = ["-pthread"] if sys.platform.startswith("linux") else []
        built.append(
            Extension(
                "nulltickets._cext.walsync",
                ["cext/walsync.c"],
                extra_compile_args=flags,
                extra_link_args=flags,
            )
        )
    try:
        from Cython.Build import cythonize
    except ImportError:
        return built
    core = Extension("nulltickets._cext.core", ["cext/core.py"])
    return built + cythonize([core], compiler_directives={"language_level": "3"}, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
