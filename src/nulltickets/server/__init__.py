"""The server's process: start-up checks and granian (launch), the limits the process can hold
(capacity) and the garbage collector's settings (heap). The app itself is `nulltickets.http`."""
