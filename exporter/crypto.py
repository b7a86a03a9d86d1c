"""Secrets the service must keep but never store in the clear (webhook signing secrets).

AES-256-GCM under a server key (``NUCLEUS_EXPORT_SECRET_KEY``, or a random key
created once in the data directory with mode 0600).
"""

from __future__ import annotations

import base64
import hashlib
import os

from cryptography.hazmat.primitives.ciphers.aead import AESGCM


class SecretBox:
    def __init__(self, key_material: bytes):
        self._aead = AESGCM(hashlib.sha256(b"nucleus-export/secret-box/v1\0" + key_material).digest())

    def seal(self, plaintext: str) -> str:
        nonce = os.urandom(12)
        return "v1:" + base64.urlsafe_b64encode(nonce + self._aead.encrypt(nonce, plaintext.encode(), None)).decode()

    def open(self, sealed: str) -> str:
        raw = base64.urlsafe_b64decode(sealed.removeprefix("v1:"))
        return self._aead.decrypt(raw[:12], raw[12:], None).decode()
