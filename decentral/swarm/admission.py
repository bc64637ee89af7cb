"""Who may take part in a swarm: records signed by the peer they describe, and an optional swarm key.

- **Signed records** (always): every DHT record we write carries the signature of its writer's libp2p
  identity (the RSA key its peer id is the hash of), over key, subkey, value and expiry. Every subkey
  we use names the peer it is about (`<peer id>` or `<name>/<peer id>`), and a record is valid only
  when that peer signed it. So nobody can beat a heartbeat, mark `left`, announce a round or publish
  an expert in another peer's name, nor stretch a signed record's expiry; our DHT nodes refuse to
  store anything else, and drop it from lookups.
- **Swarm key** (`decentral swarm keygen`): with one, records are also sealed (AES-GCM under a key
  derived from it), so a peer without the key can neither read nor write them, and every stream we
  open starts with a token, HMAC(key, opener, receiver, protocol), without which the receiver closes
  the stream unread: no pushes, no parts, no state, no experts for a stranger.

What a keyless stranger can still do: reach hivemind's DHT routing (ping, find nodes, store records
under keys that are not ours) and open connections that get closed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct
from pathlib import Path

import msgpack
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.serializer import MSGPackSerializer

KEY_ENV = "DECENTRAL_SWARM_KEY"  # path of the swarm key file, when no --swarm-key is given
KEY_BYTES = 32
TOKEN_BYTES = 32
_NONCE_BYTES = 12
_KEY_TEXT = re.compile(rf"[0-9a-fA-F]{{{2 * KEY_BYTES}}}")  # a key as its file holds it


class AdmissionError(RuntimeError):
    """A swarm key or identity file is missing or malformed."""


class SwarmKey:
    """A secret shared by a swarm's members (32 random bytes, hex in a file)."""

    def __init__(self, secret: bytes):
        if len(secret) != KEY_BYTES:
            raise AdmissionError(f"a swarm key is {KEY_BYTES} bytes, not {len(secret)}")
        self._stream = hmac.new(secret, b"decentral/stream", hashlib.sha256).digest()
        self._records = AESGCM(hmac.new(secret, b"decentral/records", hashlib.sha256).digest())
        self.fingerprint = hashlib.sha256(secret).hexdigest()[:12]  # to say which key, never the key

    @classmethod
    def generate(cls, path: str | Path) -> "SwarmKey":
        """Write a new key to `path` (readable by its owner only); refuses to overwrite one."""
        path = Path(path)
        secret = secrets.token_bytes(KEY_BYTES)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise AdmissionError(f"{path} exists; remove it first if you mean to replace the swarm's key") from None
        except OSError as e:  # a missing folder, no permission
            raise AdmissionError(f"cannot write swarm key {path}: {e.strerror or e}") from None
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex() + "\n")
        return cls(secret)

    @classmethod
    def load(cls, path: str | Path) -> "SwarmKey":
        path = Path(path)
        try:
            text = path.read_text().strip()
        except OSError as e:
            if _KEY_TEXT.fullmatch(str(path)):  # the key itself, given as its file
                raise AdmissionError("the swarm key's file is given (--swarm-key FILE, $DECENTRAL_SWARM_KEY), not the "
                                     "key itself: write it into a file and give its path") from None
            raise AdmissionError(f"cannot read swarm key {path}: {e.strerror or e}") from e
        if not _KEY_TEXT.fullmatch(text):  # an empty file too
            raise AdmissionError(f"{path} is not a swarm key ({2 * KEY_BYTES} hex digits, as `decentral swarm keygen` "
                                 f"writes; it holds {len(text)} characters)")
        return cls(bytes.fromhex(text))

    def stream_token(self, opener: str, receiver: str, protocol: str) -> bytes:
        """What `opener` sends first on a stream to `receiver`; libp2p authenticates both ids."""
        return hmac.new(self._stream, f"{opener}\n{receiver}\n{protocol}".encode(), hashlib.sha256).digest()

    def seal(self, data: bytes, context: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return nonce + self._records.encrypt(nonce, data, context)

    def unseal(self, blob: bytes, context: bytes) -> bytes | None:
        """The sealed bytes, or None when `blob` was not sealed under this key for `context`."""
        try:
            return self._records.decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], context)
        except Exception:  # InvalidTag, or a blob too short to hold a nonce and a tag
            return None


def key_file_note(path: str | Path) -> str | None:
    """A note when users other than its owner can read the swarm key file at `path` (whoever reads it can join
    the swarm and read its records), else None (also when there is no such file: `SwarmKey.load` says so)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return None
    if not mode & 0o044:
        return None
    who = "every user of this machine" if mode & 0o004 else "the members of its group"
    return (f"note: {who} can read the swarm key {path} (mode {mode & 0o777:o}), and whoever reads it can join the "
            f"swarm; `chmod 600 {path}` keeps it yours")


OPEN_SWARM_NOTICE = ("note: this swarm is open: anyone who can reach a member can join it, push parts and read "
                     "its records. `decentral swarm keygen FILE` makes a key; give it to every member with "
                     f"--swarm-key FILE (or ${KEY_ENV}).")


def ensure_identity(path: str | Path) -> Path:
    """The libp2p identity (private key) file at `path`, created when missing."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return path


def _peer_id_of(public_key: bytes) -> str:
    """libp2p peer id of a serialized (protobuf) public key: the sha2-256 multihash, base58."""
    return PeerID(multihash.encode(hashlib.sha256(public_key).digest(), "sha2-256")).to_base58()


class SignedRecords(RecordValidatorBase):
    """hivemind record validator: signs what we store, and accepts only records signed by the peer the
    subkey names (sealed under the swarm key when there is one). See the module docstring."""

    def __init__(self, identity_path: str | Path, swarm_key: SwarmKey | None = None):
        try:
            der = crypto_pb2.PrivateKey.FromString(Path(identity_path).read_bytes()).data
            self._private = serialization.load_der_private_key(der, password=None)
        except Exception as e:
            raise AdmissionError(f"{identity_path} is not a libp2p identity file: {e}") from e
        public_der = self._private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        self._public = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
        self.peer_id = _peer_id_of(self._public)
        self._swarm_key = swarm_key
        self._verified: dict[bytes, tuple[str, object]] = {}  # public key → (peer id, loaded key)

    @staticmethod
    def _signed_bytes(record: DHTRecord, body: bytes) -> bytes:
        return b"\n".join([record.key, record.subkey, struct.pack(">d", record.expiration_time), body])

    def sign_value(self, record: DHTRecord) -> bytes:
        signature = self._private.sign(self._signed_bytes(record, record.value), padding.PKCS1v15(), hashes.SHA256())
        envelope = msgpack.packb([record.value, self._public, signature])
        return envelope if self._swarm_key is None else self._swarm_key.seal(envelope, record.key + record.subkey)

    def _open(self, record: DHTRecord) -> tuple[bytes, bytes, bytes] | None:
        blob = record.value
        if self._swarm_key is not None:
            blob = self._swarm_key.unseal(blob, record.key + record.subkey)
            if blob is None:
                return None
        try:
            body, public, signature = msgpack.unpackb(blob)
            return bytes(body), bytes(public), bytes(signature)
        except Exception:
            return None

    def _signer(self, public: bytes) -> tuple[str, object] | None:
        if public not in self._verified:
            try:
                key = crypto_pb2.PublicKey.FromString(public)
                loaded = serialization.load_der_public_key(key.data)
            except Exception:
                return None
            if len(self._verified) > 4096:
                self._verified.clear()
            self._verified[public] = (_peer_id_of(public), loaded)
        return self._verified[public]

    def validate(self, record: DHTRecord) -> bool:
        opened = self._open(record)
        if opened is None:
            return False
        body, public, signature = opened
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return False
        signer = self._signer(public)
        if signer is None or not isinstance(subkey, str) or subkey.rsplit("/", 1)[-1] != signer[0]:
            return False
        try:
            signer[1].verify(signature, self._signed_bytes(record, body), padding.PKCS1v15(), hashes.SHA256())
        except (InvalidSignature, TypeError, ValueError):
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        opened = self._open(record)
        return opened[0] if opened is not None else record.value
