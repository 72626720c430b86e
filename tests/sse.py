"""A raw Server-Sent Events client over a plain socket: reads the chunked body as it comes and
splits it into events and comment lines, so tests see exactly what the server sends."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Message:
    id: int | None = None
    data: Any = None
    comment: str | None = None


@dataclass
class SseClient:
    port: int
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    ended: bool = False
    _sock: socket.socket | None = None
    _raw: bytes = b""  # received, not yet de-chunked
    _text: str = ""  # de-chunked, not yet split into messages

    def open(self, timeout: float = 10.0) -> SseClient:
        self._sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        self._sock.sendall(f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
        while b"\r\n\r\n" not in self._raw:
            self._recv()
        head, self._raw = self._raw.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.response_headers[name.strip().lower()] = value.strip()
        return self

    def body(self, timeout: float = 10.0) -> bytes:
        """For a reply that is not a stream: its whole body."""
        length = int(self.response_headers.get("content-length", "0"))
        deadline = time.monotonic() + timeout
        while len(self._raw) < length and time.monotonic() < deadline:
            self._recv()
        return self._raw[:length]

    def _recv(self) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(65536)
        if not chunk:
            self.ended = True
            raise EOFError("the server closed the stream")
        self._raw += chunk

    def _dechunk(self) -> None:
        while True:
            size_line, sep, rest = self._raw.partition(b"\r\n")
            if not sep:
                return
            size = int(size_line, 16)
            if size == 0:
                self.ended = True
                self._raw = b""
                return
            if len(rest) < size + 2:
                return
            self._text += rest[:size].decode()
            self._raw = rest[size + 2 :]

    def next(self, timeout: float = 10.0) -> Message:
        """The next event or comment; raises TimeoutError or EOFError."""
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while True:
            self._dechunk()
            if "\n\n" in self._text:
                block, self._text = self._text.split("\n\n", 1)
                return _parse(block)
            if self.ended:
                raise EOFError("the stream ended")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message in time")
            self._sock.settimeout(left)
            try:
                self._recv()
            except TimeoutError:
                raise TimeoutError("no message in time") from None

    def next_event(self, timeout: float = 10.0) -> Message:
        """The next message with data, skipping comments and the retry line."""
        while True:
            message = self.next(timeout)
            if message.data is not None:
                return message

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _parse(block: str) -> Message:
    message = Message()
    data: list[str] = []
    for line in block.split("\n"):
        if line.startswith(":"):
            message.comment = line[1:].strip()
        elif line.startswith("id:"):
            message.id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        message.data = json.loads("\n".join(data))
    return message
