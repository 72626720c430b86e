"""FOR TESTS ONLY: an SQLite VFS that turns a SIGKILL into a power cut.

Never used unless the environment variable NULLTICKETS_TEST_POWERCUT_VFS is set (see
`connection.py`); the server then logs a warning at every start. It makes the server slower and
it keeps unsynced data in memory: it exists so that the reliability suites can check what each
`--durability` mode survives when the power goes, not only when the process dies.

The model is a disk with a volatile write cache (the kernel's page cache, the drive's cache):

- Every write to a database file, its WAL or its rollback journal since that file's last xSync
  is kept in memory. Reads see it (every connection of the process shares one overlay per file,
  as they would share the page cache), but the real file does not get it.
- xSync writes the pending writes through, in order. The real file only has to outlive a SIGKILL,
  which it does without an fsync, so none is made: "synced" means "in the real file".
- A SIGKILL of the process is then a power cut: everything not synced is gone.
- A cut can also be simulated by the VFS itself (`cut-file`, `cut-at`): then, as a real disk
  might, a random part of the pending writes reaches the file before the process SIGKILLs itself,
  in random order with `reorder`, the last one torn (a random prefix of it kept) with `tear`.
- `lying`: xSync writes nothing through, a disk that acknowledges flushes it never made.
- A clean close of the last handle of a file writes its pending writes through: data in the page
  cache outlives the exit of a process, only not a power cut. (At a clean close SQLite has
  checkpointed and synced anyway; the granian supervisor's start-up migration ends that way.)
- The overlays belong to one process. The granian supervisor migrates and closes the database
  before it starts the worker, so the worker starts with nothing pending; while the server
  runs only the worker has the files open. Another process opening them meanwhile would see
  the real files without the worker's pending writes, under a WAL index that describes them
  (SQLite then reports a disk I/O error): the tests look at the files only once every process
  of the server has exited, not merely been sent SIGKILL.
- The -shm file (the WAL index) goes to the default VFS untouched: apsw's VFSFile hands the
  xShm* methods to the VFS it inherits from, so WAL works as it does without this layer. It is
  shared memory, which a power cut wipes; after a SIGKILL of the server the first connection to
  open the database finds no other one, truncates it and rebuilds it from what the WAL file
  really holds.
- The device is reported with no guarantees beyond powersafe overwrite (the torn write changes
  nothing outside its own range), so SQLite never skips a sync on its account.

The switch's value is a comma-separated list of options:

    on                   just the model (any value turns the VFS on; "on" says nothing else)
    lying                xSync writes nothing through
    lying-thread=NAME    xSync writes nothing through when called on the thread named NAME
                         (e.g. the writer's WAL sync thread: durability full without its barrier)
    tear                 a simulated cut tears the last write that reaches the file
    reorder              a simulated cut applies a random subset of pending writes, in random order
    seed=N               the random choices of simulated cuts
    cut-file=PATH        simulate a cut at the first write or sync after PATH exists
    cut-at=KIND:N[:THREAD]  simulate a cut at the N-th write to a file of KIND (db, wal, journal)
                         in this process, counting only writes made on the thread named THREAD
    report=PATH          append one JSON line per simulated cut (what was kept, what was lost)
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import apsw

from nulltickets.storage.sqlite import walsync

ENV = "NULLTICKETS_TEST_POWERCUT_VFS"
NAME = "nulltickets-powercut"
BLOCK = 4096

KINDS = {
    apsw.SQLITE_OPEN_MAIN_DB: "db",
    apsw.SQLITE_OPEN_WAL: "wal",
    apsw.SQLITE_OPEN_MAIN_JOURNAL: "journal",
}


@dataclass
class Options:
    lying: bool = False
    lying_thread: str | None = None
    tear: bool = False
    reorder: bool = False
    seed: int | None = None
    cut_file: str | None = None
    cut_at: tuple[str, int, str | None] | None = None
    report: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Options:
        opts = cls()
        for item in (part.strip() for part in spec.split(",")):
            key, _, value = item.partition("=")
            if key in ("", "on", "1"):
                continue
            if key in ("lying", "tear", "reorder"):
                setattr(opts, key, True)
            elif key == "seed":
                opts.seed = int(value)
            elif key == "cut-file":
                opts.cut_file = value
            elif key == "lying-thread":
                opts.lying_thread = value
            elif key == "report":
                opts.report = value
            elif key == "cut-at":
                kind, _, rest = value.partition(":")
                count, _, thread = rest.partition(":")
                if kind not in KINDS.values() or not count.isdigit() or int(count) < 1:
                    raise ValueError(f"{ENV}: cut-at wants KIND:N[:THREAD], got {value!r}")
                opts.cut_at = (kind, int(count), thread or None)
            else:
                raise ValueError(f"{ENV}: unknown option {item!r}")
        return opts


Op = tuple[int, bytes | None]  # (offset, data) a write, (size, None) a truncate


@dataclass
class Overlay:
    """One file's writes since its last sync, and its content as this process sees it."""

    kind: str
    size: int  # the file's size as this process sees it
    base_size: int  # the real file's size
    floor: int  # real bytes at or past this offset are gone (a pending truncate cut them off)
    blocks: dict[int, bytearray] = field(default_factory=dict)  # content of written blocks
    ops: list[Op] = field(default_factory=list)  # pending, in the order they were made
    handles: list[apsw.VFSFile] = field(default_factory=list)  # open on it in this process

    def _real(self, base: apsw.VFSFile, offset: int, amount: int) -> bytes:
        """`amount` bytes at `offset` of what the real file still holds for us, zero-filled."""
        end = min(offset + amount, self.base_size, self.floor)
        data = apsw.VFSFile.xRead(base, end - offset, offset) if end > offset else b""
        return data + bytes(amount - len(data))

    def _block(self, base: apsw.VFSFile, index: int) -> bytearray:
        block = self.blocks.get(index)
        if block is None:
            block = self.blocks[index] = bytearray(self._real(base, index * BLOCK, BLOCK))
        return block

    def read(self, base: apsw.VFSFile, amount: int, offset: int) -> bytes:
        end = min(offset + amount, self.size)
        if end <= offset:
            return b""
        out = bytearray(self._real(base, offset, end - offset))
        if self.blocks:
            for index in range(offset // BLOCK, (end - 1) // BLOCK + 1):
                block = self.blocks.get(index)
                if block is not None:
                    lo, hi = max(offset, index * BLOCK), min(end, (index + 1) * BLOCK)
                    out[lo - offset : hi - offset] = block[lo - index * BLOCK : hi - index * BLOCK]
        return bytes(out)

    def write(self, base: apsw.VFSFile, data: bytes, offset: int) -> None:
        self.ops.append((offset, data))
        end = offset + len(data)
        for index in range(offset // BLOCK, (end - 1) // BLOCK + 1):
            block = self._block(base, index)
            lo, hi = max(offset, index * BLOCK), min(end, (index + 1) * BLOCK)
            block[lo - index * BLOCK : hi - index * BLOCK] = data[lo - offset : hi - offset]
        self.size = max(self.size, end)

    def truncate(self, size: int) -> None:
        self.ops.append((size, None))
        self.size = size
        self.floor = min(self.floor, size)
        for index in [i for i in self.blocks if i * BLOCK >= size]:
            del self.blocks[index]
        partial = self.blocks.get(size // BLOCK)
        if partial is not None:
            cut = size % BLOCK
            partial[cut:] = bytes(BLOCK - cut)

    def flush(self, base: apsw.VFSFile) -> None:
        """Write every pending write through to the real file, in order."""
        apply(base, self.ops)
        self.ops = []
        self.blocks = {}
        self.base_size = self.floor = self.size


def apply(base: apsw.VFSFile, ops: list[Op]) -> None:
    for offset, data in ops:
        if data is None:
            apsw.VFSFile.xTruncate(base, offset)
        elif data:
            apsw.VFSFile.xWrite(base, data, offset)


class PowercutFile(apsw.VFSFile):
    def __init__(self, vfs: PowercutVFS, name: Any, flags: list[int]) -> None:
        super().__init__("", name, flags)
        self.vfs = vfs
        self.key: str | None = None
        self.overlay: Overlay | None = None
        path = name.filename() if isinstance(name, apsw.URIFilename) else name
        kind = next((k for bit, k in KINDS.items() if flags[0] & bit), None)
        if path and kind:
            self.key = str(path)
            with vfs.lock:
                overlay = vfs.overlays.get(self.key)
                if overlay is None:
                    size = super().xFileSize()
                    overlay = vfs.overlays[self.key] = Overlay(kind, size, size, size)
                overlay.handles.append(self)
                self.overlay = overlay

    def xRead(self, amount: int, offset: int) -> bytes:
        if self.overlay is None:
            return super().xRead(amount, offset)
        with self.vfs.lock:
            return self.overlay.read(self, amount, offset)

    def xWrite(self, data: Any, offset: int) -> None:
        if self.overlay is None:
            super().xWrite(data, offset)
            return
        with self.vfs.lock:
            if self.vfs.dead:
                return
            self.overlay.write(self, bytes(data), offset)
            self.vfs.wrote(self.overlay.kind)

    def xTruncate(self, newsize: int) -> None:
        if self.overlay is None:
            super().xTruncate(newsize)
            return
        with self.vfs.lock:
            if self.vfs.dead:
                return
            self.overlay.truncate(newsize)
            self.vfs.check_cut_file()

    def xFileSize(self) -> int:
        if self.overlay is None:
            return super().xFileSize()
        with self.vfs.lock:
            return self.overlay.size

    def xSync(self, flags: int) -> None:
        if self.overlay is None:
            super().xSync(flags)
            return
        with self.vfs.lock:
            self.vfs.check_cut_file()
            self.vfs.syncs += 1
            if not (self.vfs.options.lying or self.vfs.dead or self.vfs.lies_here()):
                self.overlay.flush(self)

    def xDeviceCharacteristics(self) -> int:
        return super().xDeviceCharacteristics() & apsw.SQLITE_IOCAP_POWERSAFE_OVERWRITE

    def xClose(self) -> None:
        overlay, self.overlay = self.overlay, None
        if overlay is not None and self.key is not None:
            with self.vfs.lock:
                overlay.handles.remove(self)
                if not overlay.handles:
                    # A clean close: the page cache outlives the process (see the module's text).
                    if not self.vfs.dead:
                        overlay.flush(self)
                    if self.vfs.overlays.get(self.key) is overlay:
                        del self.vfs.overlays[self.key]
        super().xClose()


class PowercutVFS(apsw.VFS):
    """Layered on the default VFS; one per process (`install`)."""

    def __init__(self, options: Options, name: str = NAME) -> None:
        self.options = options
        self.lock = threading.RLock()
        self.overlays: dict[str, Overlay] = {}
        self.writes: dict[str, int] = {}
        self.syncs = 0
        self.dead = False  # after simulate_cut in a process that goes on: no I/O reaches a file
        self.rng = random.Random(options.seed)
        super().__init__(name, "")

    def lies_here(self) -> bool:
        thread = self.options.lying_thread
        return thread is not None and walsync.current_thread_name() == thread

    def xOpen(self, name: Any, flags: list[int]) -> apsw.VFSFile:
        return PowercutFile(self, name, flags)

    def xDelete(self, filename: str, syncdir: bool) -> None:
        with self.lock:
            if self.dead:
                return
            self.overlays.pop(filename, None)
        super().xDelete(filename, syncdir)

    # --- simulated cuts ----------------------------------------------------------------------

    def wrote(self, kind: str) -> None:
        if self.dead:
            return
        cut_at = self.options.cut_at
        if (
            cut_at is not None
            and cut_at[0] == kind
            and cut_at[2] in (None, walsync.current_thread_name())
        ):
            self.writes[kind] = self.writes.get(kind, 0) + 1
            if self.writes[kind] >= cut_at[1]:
                self.cut(f"write {cut_at[1]} to the {kind} file")
        self.check_cut_file()

    def check_cut_file(self) -> None:
        if not self.dead and self.options.cut_file and os.path.exists(self.options.cut_file):
            self.cut(f"{self.options.cut_file} appeared")

    def cut(self, reason: str) -> None:
        """The power goes now: part of the pending writes reach the files, then SIGKILL."""
        report = self.simulate_cut(reason)
        if self.options.report:
            with open(self.options.report, "a", encoding="utf-8") as out:
                out.write(json.dumps(report) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def simulate_cut(self, reason: str) -> dict[str, Any]:
        """Decide what of the pending writes of every file reached the disk, write that to the
        real files, and forget everything else. Returns what happened, for the report.

        Without `reorder` the disk wrote the pending writes in order and stopped after a random
        number of them (without `tear` either: after none, as a SIGKILL would); with `reorder` a
        random subset reached it, in random order. With `tear` the last one that reached it
        did so only in part: a random prefix of it."""
        with self.lock:
            out: dict[str, Any] = {
                "reason": reason,
                "t_ms": time.time_ns() // 1_000_000,
                "pid": os.getpid(),
                "files": {},
            }
            for key, overlay in list(self.overlays.items()):
                ops = overlay.ops
                if self.options.reorder:
                    kept = [op for op in ops if self.rng.random() < 0.5]
                    self.rng.shuffle(kept)
                elif self.options.tear and ops:
                    kept = ops[: self.rng.randint(1, len(ops))]
                else:
                    kept = []
                torn = None
                if self.options.tear and kept and kept[-1][1]:
                    offset, data = kept[-1]
                    assert data is not None
                    torn = self.rng.randrange(len(data))
                    kept[-1] = (offset, data[:torn])
                if kept and overlay.handles:
                    apply(overlay.handles[0], kept)
                out["files"][key] = {
                    "kind": overlay.kind,
                    "pending": len(ops),
                    "kept": len(kept),
                    "torn_to": torn,
                }
                overlay.ops = []
                overlay.blocks = {}
                overlay.base_size = overlay.floor = overlay.size = (
                    apsw.VFSFile.xFileSize(overlay.handles[0]) if overlay.handles else 0
                )
            self.dead = True
            return out


_installed: PowercutVFS | None = None


def install(spec: str) -> str:
    """Register the VFS (once per process) with the options in `spec`; returns its name."""
    global _installed
    if _installed is None:
        import logging

        _installed = PowercutVFS(Options.parse(spec))
        logging.getLogger("nulltickets.storage").warning(
            "TEST ONLY: %s=%r is set: database files go through the power-cut VFS (unsynced "
            "writes live in memory only). Never run a real server with it.",
            ENV,
            spec,
        )
    return NAME


def installed() -> PowercutVFS | None:
    return _installed
