"""The pool's control channel: length-prefixed frames over TCP on 127.0.0.1, every frame signed with HMAC-SHA256.

Stdlib only (the ranks import it too). As in Jupyter's wire protocol, a random key per pool signs every message;
here the signature also covers a per-connection nonce, the direction and a sequence number, so a frame cannot be
replayed, reordered, reflected back to its sender or moved to another connection.

Handshake: the listening side (the kernel) sends 16 random bytes (the nonce) in clear; the connecting side (a rank)
answers with a signed ``hello``; the kernel answers with a signed ``welcome``. A peer without the key cannot produce
a valid ``hello``: the kernel refuses the connection and logs it. The ranks check the kernel's signatures too, so
a process that bound the port first could not make a rank execute anything.

Frame::

    u64 length (of what follows) | 32-byte HMAC | u32 header length | header (JSON, UTF-8) | blob (raw bytes)

    HMAC = HMAC-SHA256(key, nonce | direction (b"K" kernel->rank, b"R" rank->kernel) | u64 seq | body)

The header is decoded, and a blob (cloudpickle) unpickled by the caller, only after the signature was checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
from typing import Any

from ..errors import JupyterDistError

__all__ = ["AuthError", "Channel", "ChannelClosed", "NONCE_SIZE", "new_key", "recv_exact"]

NONCE_SIZE = 16
MAC_SIZE = 32
_LEN = struct.Struct("!Q")
_HLEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
MAX_FRAME = 1 << 40
"""Largest frame accepted from an authenticated peer (1 TiB: a guard against a corrupt length, not a quota)."""
MAX_UNAUTHENTICATED = 64 * 1024
"""Largest first frame accepted before the peer has proven it holds the key."""


class AuthError(JupyterDistError):
    """A frame's signature is wrong (the peer does not hold the pool's key) or its sequence is broken."""


class ChannelClosed(JupyterDistError, EOFError):
    """The peer closed the connection (or it broke)."""


def new_key() -> bytes:
    """A fresh random 32-byte key."""
    return os.urandom(32)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes; :class:`ChannelClosed` when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, socket.timeout):
                raise
            raise ChannelClosed(f"connection broke: {exc}") from None
        if k == 0:
            raise ChannelClosed("connection closed by the peer")
        got += k
    return buf


class Channel:
    """One authenticated connection; ``send`` is thread-safe, ``recv`` is meant for one reading thread.

    Parameters
    ----------
    sock
        A connected socket.
    key
        The pool's secret key.
    nonce
        This connection's nonce (sent by the kernel in clear when the connection opens).
    kernel_side
        ``True`` for the kernel's end (it signs with direction ``K`` and expects ``R``), ``False`` for a rank's.
    """

    def __init__(self, sock: socket.socket, key: bytes, nonce: bytes, *, kernel_side: bool) -> None:
        if len(key) < 16:
            raise ValueError(f"the pool key must have at least 16 bytes, got {len(key)}")
        self.sock = sock
        self._key = key
        self._nonce = bytes(nonce)
        self._out, self._in = (b"K", b"R") if kernel_side else (b"R", b"K")
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self.authenticated = False
        """Whether a frame from the peer has passed the signature check."""

    def _mac(self, direction: bytes, seq: int, parts: list[bytes | bytearray | memoryview]) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(self._nonce)
        mac.update(direction)
        mac.update(_SEQ.pack(seq))
        for part in parts:
            mac.update(part)
        return mac.digest()

    def send(self, header: dict[str, Any], blob: bytes | bytearray | memoryview = b"") -> None:
        """Sign and send one message (a JSON-able header and optional raw bytes)."""
        head = json.dumps(header, separators=(",", ":")).encode()
        prefix = _HLEN.pack(len(head)) + head
        with self._send_lock:
            self._send_seq += 1
            mac = self._mac(self._out, self._send_seq, [prefix, blob])
            frame_len = MAC_SIZE + len(prefix) + len(blob)
            try:
                self.sock.sendall(_LEN.pack(frame_len) + mac + prefix)
                if len(blob):
                    self.sock.sendall(blob)
            except OSError as exc:
                raise ChannelClosed(f"cannot send: {exc}") from None

    def recv(self, *, max_size: int = MAX_FRAME) -> tuple[dict[str, Any], memoryview]:
        """Receive and verify one message; raises :class:`AuthError` on a bad signature, before decoding anything."""
        (frame_len,) = _LEN.unpack(recv_exact(self.sock, _LEN.size))
        if not MAC_SIZE + _HLEN.size <= frame_len <= max_size:
            raise AuthError(f"frame of {frame_len} bytes refused (expected {MAC_SIZE + _HLEN.size}..{max_size})")
        frame = recv_exact(self.sock, frame_len)
        view = memoryview(frame)
        expected = self._mac(self._in, self._recv_seq + 1, [view[MAC_SIZE:]])
        if not hmac.compare_digest(bytes(view[:MAC_SIZE]), expected):
            raise AuthError("bad signature: the peer does not hold this pool's key (or replayed a frame)")
        self._recv_seq += 1
        self.authenticated = True
        (head_len,) = _HLEN.unpack_from(frame, MAC_SIZE)
        start = MAC_SIZE + _HLEN.size
        if start + head_len > frame_len:
            raise AuthError("malformed frame: header longer than the frame")
        header: dict[str, Any] = json.loads(bytes(view[start : start + head_len]))
        return header, view[start + head_len :]  # no copy of a large blob

    def close(self) -> None:
        """Close the socket (idempotent)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
