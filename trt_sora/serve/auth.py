"""API keys of the server (``trt-sora serve --api-keys-file PATH``).

The file holds one key a line, optionally after an id that names it in logs, job records and quotas
(``ID KEY``; without one the id is ``key-`` and 8 hex digits of the key's sha256). Blank lines and
``#`` comments are skipped. Only the keys' sha256 digests are kept in memory, and a presented key is
compared with every digest in constant time, so neither the answer nor its timing tells which
prefix matched. :meth:`ApiKeys.reload` (the server calls it on SIGHUP) swaps the whole set at once,
or keeps the old one when the new file is bad.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import threading
from pathlib import Path

from trt_sora.errors import ConfigError

__all__ = ["ApiKeys", "is_loopback"]

MIN_KEY_CHARS = 16  # a shorter key is guessable; refused when the file is read
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ApiKeys:
    """The keys of ``path`` (read now; ConfigError naming the line when the file is unusable)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._digests: list[tuple[bytes, str]] = self._read()

    def __len__(self) -> int:
        return len(self._digests)

    def reload(self) -> int:
        """Read the file again and swap the keys in; returns their number. On a bad file the old
        keys stay and the ConfigError propagates (the server logs it)."""
        digests = self._read()
        with self._lock:
            self._digests = digests
        return len(digests)

    def identify(self, authorization: str | None) -> str | None:
        """The id of the key in an ``Authorization: Bearer KEY`` header value, else None."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = _digest(key.strip())
        with self._lock:
            digests = self._digests
        found = None
        for d, key_id in digests:  # every digest compared: the time does not depend on which one matches
            if hmac.compare_digest(d, digest) and found is None:
                found = key_id
        return found

    def _read(self) -> list[tuple[bytes, str]]:
        where = f"--api-keys-file {self.path}"
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read it ({exc.strerror}); give a file with one API key a line"
                              ) from None
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: not UTF-8 text; give a file with one API key a line") from None
        out: list[tuple[bytes, str]] = []
        ids: set[str] = set()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ConfigError(f"{where}:{n}: expected `KEY` or `ID KEY`, got {len(parts)} fields")
            key = parts[-1]
            key_id = parts[0] if len(parts) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
            if len(key) < MIN_KEY_CHARS:
                raise ConfigError(f"{where}:{n}: the key has {len(key)} characters; use at least {MIN_KEY_CHARS} "
                                  "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
            if not _ID.fullmatch(key_id):
                raise ConfigError(f"{where}:{n}: id {key_id!r}: use letters, digits, '.', '_', '-' (64 at most)")
            if key_id in ids:
                raise ConfigError(f"{where}:{n}: id {key_id!r} appears twice; give each key its own id")
            ids.add(key_id)
            out.append((_digest(key), key_id))
        if not out:
            raise ConfigError(f"{where}: holds no key; add one key a line (or drop --api-keys-file)")
        return out


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
