"""Real TLS in front of a plain Redis for tests: a throwaway CA and server certificate made
with ``cryptography``, and a TLS-terminating TCP proxy (``ssl`` + asyncio in a thread) that
forwards each connection to the server's plain port. The embedded valkey is built without
TLS; clients of the proxy speak TLS on the wire exactly as to ``redis-server --tls-port``."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path


def _name(cn: str):
    from cryptography.x509 import Name, NameAttribute
    from cryptography.x509.oid import NameOID

    return Name([NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(directory: Path, *, cn: str = "shoal test CA") -> Pki:
    """A CA (``ca.pem``) and a server certificate for ``localhost`` / ``127.0.0.1`` signed by
    it (``server.pem``, ``server.key``), valid for a day, in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pki = Pki(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server.key")
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    pki.key.chmod(0o600)
    return pki


class TlsProxy:
    """Accepts TLS on 127.0.0.1:``port`` and relays the decrypted bytes to ``backend_port``.
    ``handshakes`` counts completed TLS handshakes, ``failed`` the refused ones (e.g. a client
    that does not trust the CA, or one speaking plain RESP)."""

    def __init__(self, pki: Pki, backend_port: int):
        self.backend_port = backend_port
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ctx.load_cert_chain(pki.cert, pki.key)
        self.handshakes = 0
        self.failed = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-proxy", daemon=True)

    def start(self) -> "TlsProxy":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("TLS proxy did not start")
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(
            self._serve, "127.0.0.1", 0, ssl=self.ctx, ssl_handshake_timeout=10))
        self._loop.set_exception_handler(self._on_error)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    def _on_error(self, loop, context) -> None:
        # failed handshakes surface here (asyncio logs them otherwise)
        if isinstance(context.get("exception"), (ssl.SSLError, ConnectionError, OSError)):
            self.failed += 1
        else:
            loop.default_exception_handler(context)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError, OSError):
                pass
            finally:
                try:
                    dst.close()
                except (ConnectionError, ssl.SSLError, OSError, RuntimeError):
                    pass

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        except asyncio.CancelledError:  # stop(): end quietly
            for w in (writer, up_writer):
                w.transport.abort()
