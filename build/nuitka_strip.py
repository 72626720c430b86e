"""Nuitka user plugin: strip debug information from the shared objects copied into the binary.

Wheels and pyenv builds ship some extension modules unstripped (uvloop's `loop.so` is 13 MB with
its debug info, 1.6 MB without); Nuitka strips only what it compiles. Linux only: on macOS the
copies are signed afterwards and Windows DLLs carry no such sections.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from nuitka.plugins.PluginBase import NuitkaPluginBase


class NuitkaPluginStripSharedObjects(NuitkaPluginBase):
    plugin_name = "nulltickets-strip"
    plugin_desc = "Strip debug info from copied shared objects (Linux)."

    def __init__(self) -> None:
        self.strip = shutil.which("strip") if sys.platform.startswith("linux") else None
        self.saved = 0

    @staticmethod
    def isAlwaysEnabled() -> bool:
        return True

    def onCopiedDLL(self, dll_filename: str) -> None:
        if self.strip is None:
            return
        import os

        before = os.path.getsize(dll_filename)
        subprocess.run([self.strip, "--strip-unneeded", dll_filename], check=True)
        self.saved += before - os.path.getsize(dll_filename)

    def onStandaloneDistributionFinished(self, dist_dir: str) -> None:
        if self.strip is not None:
            self.info(f"stripped {self.saved / 1e6:.1f} MB of symbols from shared objects")
