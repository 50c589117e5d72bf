"""TLS certificates and SuperNode keys for a CoLLM federation, and registering the edges' keys.

    python -m collm.lab.certs make OUT_DIR [EDGE ...] [--san DNS:fl.example.org] [--days 365]
    python -m collm.lab.certs register --superlink HOST:PORT --root-certificates CA PUB [PUB ...]

`make` writes, in OUT_DIR (default edges: edge1 edge2 edge3):

    ca.crt, ca.key                  a private CA (ca.key signs, keep it off the devices)
    superlink.crt, superlink.key    the SuperLink's certificate: SANs localhost, superlink,
                                    127.0.0.1 and every --san
    EDGE, EDGE.pub                  one ECDSA P-384 key pair per edge, OpenSSH format (what
                                    `ssh-keygen -t ecdsa -b 384` makes; flower-supernode reads it)

Files already there are kept, so a second `make` adds only what is missing (a new edge) and
re-issues the SuperLink certificate only when it lacks a requested SAN. Private keys are 0600.

`register` adds each PUB (name: the file name without `.pub`) to a SuperLink started with
`--enable-supernode-auth`, over its Control API, as `flwr supernode register PUB <conn> --name
NAME` does, but without a `$FLWR_HOME/config.toml` connection, waiting for the SuperLink to
answer (`--wait`), and idempotent: a key that is already registered is reported, not an error
(`flwr supernode register` fails with "Public key already in use").
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
import time
from pathlib import Path

from collm.common.errors import UserError, cli_entry
from collm.common.procs import quiet_flower

DEFAULT_EDGES = ("edge1", "edge2", "edge3")
DEFAULT_SANS = ("DNS:localhost", "DNS:superlink", "IP:127.0.0.1")


# ----------------------------------------------------------------------------- make
def make_certs(out: str | Path, edges: list[str] | tuple[str, ...] = DEFAULT_EDGES, sans: list[str] = (),
               days: int = 365) -> dict[str, Path]:
    """Create (or complete) the CA, the SuperLink certificate and one key pair per edge in `out`.

    Returns the paths: `ca`, `superlink_cert`, `superlink_key`, and each edge's private key under
    its name (its public key is the same path + `.pub`).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if days < 1:
        raise UserError(f"--days {days}: give a lifetime of at least 1 day")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    want_sans = _parse_sans([*DEFAULT_SANS, *sans])
    ca_crt, ca_key_path = out / "ca.crt", out / "ca.key"
    if ca_crt.is_file() and ca_key_path.is_file():
        try:
            ca_cert = x509.load_pem_x509_certificate(ca_crt.read_bytes())
            ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise UserError(f"{out}: ca.crt / ca.key are not a PEM certificate and unencrypted key ({e}); remove "
                            f"them to make a new CA (every certificate it signed must then be made again)") from None
        expires = ca_cert.not_valid_after_utc  # cryptography >= 42; flwr 1.42 pins 50
        if expires <= _now():
            raise UserError(f"{ca_crt}: the CA expired on {expires:%Y-%m-%d}; remove ca.crt and ca.key from {out} "
                            f"to make a new one (and make every certificate again)")
    else:
        ca_cert, ca_key = _make_ca(days)
        _write(ca_key_path, _pem_key(ca_key), private=True)
        _write(ca_crt, ca_cert.public_bytes(serialization.Encoding.PEM))
    sl_crt, sl_key = out / "superlink.crt", out / "superlink.key"
    if not (sl_crt.is_file() and sl_key.is_file() and _covers(sl_crt, ca_cert, want_sans)):
        cert, key = _make_server_cert(ca_cert, ca_key, want_sans, days)
        _write(sl_key, _pem_key(key), private=True)
        _write(sl_crt, cert.public_bytes(serialization.Encoding.PEM))
    paths = {"ca": ca_crt, "superlink_cert": sl_crt, "superlink_key": sl_key}
    for name in edges:
        if not name or "/" in name or name.startswith(".") or name in ("ca", "superlink"):
            raise UserError(f"edge name {name!r}: use a plain name such as edge1")
        key_path = out / name
        if not (key_path.is_file() and key_path.with_name(name + ".pub").is_file()):
            private, public = _make_node_key(f"collm-{name}")
            _write(key_path, private, private=True)
            _write(key_path.with_name(name + ".pub"), public)
        paths[name] = key_path
    return paths


def _parse_sans(sans: list[str]) -> list:
    from cryptography import x509

    parsed = []
    for san in sans:
        kind, _, value = san.partition(":")
        if kind == "DNS" and value:
            parsed.append(x509.DNSName(value))
        elif kind == "IP" and value:
            try:
                parsed.append(x509.IPAddress(ipaddress.ip_address(value)))
            except ValueError:
                raise UserError(f"--san {san!r}: {value!r} is not an IP address") from None
        else:
            raise UserError(f"--san {san!r}: expected DNS:<name> or IP:<address>")
    return list(dict.fromkeys(parsed))


def _make_ca(days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "collm-lab-ca")])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return cert, key


def _make_server_cert(ca_cert, ca_key, sans: list, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superlink")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    return cert, key


def _covers(cert_path: Path, ca_cert, sans: list) -> bool:
    """True if the certificate at `cert_path` was signed by `ca_cert` and names every SAN."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        cert.verify_directly_issued_by(ca_cert)
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except Exception:  # noqa: BLE001 - not ours, no SANs, unreadable: issue a new one
        return False
    return all(san in have for san in sans) and cert.not_valid_after_utc > _now() + dt.timedelta(days=1)


def _make_node_key(comment: str) -> tuple[bytes, bytes]:
    """An ECDSA P-384 key pair in OpenSSH format (private, public with a comment)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + f" {comment}\n".encode()


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, 0o600 if private else 0o644)
    tmp.replace(path)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# ----------------------------------------------------------------------------- register
def register_nodes(superlink: str, root_certificates: str | Path, public_keys: list[str | Path],
                   wait_s: float = 60.0) -> dict[str, tuple[int, bool]]:
    """Register each OpenSSH public key (name: file name without `.pub`) with the SuperLink.

    Returns name -> (node id, True if registered now / False if it already was).
    """
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.cli.utils import flwr_cli_exc_handler
    from flwr.proto.control_pb2 import ListNodesRequest, RegisterNodeRequest  # pylint: disable=E0611

    from collm.server.cli import _as_user_error

    keys = {}
    for pub in map(Path, public_keys):
        name = pub.name.removesuffix(".pub")
        with _as_user_error():
            keys[name] = _public_key_bytes(pub, try_load_public_key)
    client = _wait_for_control_api(superlink, root_certificates, wait_s)
    result: dict[str, tuple[int, bool]] = {}
    try:
        with _as_user_error(), flwr_cli_exc_handler():
            nodes = client.ListNodes(ListNodesRequest()).nodes_info
            known = {n.public_key: n.node_id for n in nodes if n.status != "unregistered"}
            for name, key in keys.items():
                if key in known:
                    result[name] = (known[key], False)
                    continue
                response = client.RegisterNode(RegisterNodeRequest(public_key=key, name=name))
                if not response.node_id:
                    raise UserError(f"{name}: the SuperLink did not register the key")
                result[name] = (response.node_id, True)
    finally:
        client.close()
    return result


def _public_key_bytes(path: Path, loader) -> bytes:
    """The key as the SuperLink stores it (PEM SubjectPublicKeyInfo); one line if it is bad."""
    if not path.is_file():
        raise UserError(f"{path}: public key file not found")
    try:
        return loader(path)
    except SystemExit:  # flwr_exit, after printing why: not an EC key on a NIST curve
        raise UserError(f"{path}: not an ECDSA (NIST curve) public key in OpenSSH format") from None


def _wait_for_control_api(superlink: str, root_certificates: str | Path, wait_s: float):
    """A Control API client, once the SuperLink answers its /health over TLS."""
    import httpx

    from collm.server.cli import _as_user_error, connect

    ca = str(Path(root_certificates).resolve())
    if not Path(ca).is_file():
        raise UserError(f"{root_certificates}: CA certificate not found")
    try:
        context = _ssl_context(ca)
    except OSError as e:  # ssl.SSLError (a file that is no PEM) is one, as is a file that cannot be read
        raise UserError(f"--root-certificates {root_certificates}: not a PEM CA certificate ({e})") from None
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        try:
            if httpx.get(f"https://{superlink}/health", verify=context, timeout=3).status_code == 200:
                break
            last = "no 200 from /health"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise UserError(f"the SuperLink at https://{superlink} did not answer within {wait_s:g} s ({last})")
        time.sleep(0.5)
    with _as_user_error():
        return connect(superlink, insecure=False, root_certificates=ca)


def _ssl_context(ca: str):
    import ssl

    return ssl.create_default_context(cafile=ca)


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m collm.lab.certs", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="make the CA, the SuperLink certificate and the edges' key pairs")
    m.add_argument("out", help="folder for the files (created; files already there are kept)")
    m.add_argument("edges", nargs="*", default=list(DEFAULT_EDGES), help="edge names (default: edge1 edge2 edge3)")
    m.add_argument("--san", action="append", default=[], metavar="DNS:NAME|IP:ADDR",
                   help="another name of the SuperLink (default SANs: localhost, superlink, 127.0.0.1)")
    m.add_argument("--days", type=int, default=365, help="certificate lifetime (default: %(default)s)")
    r = sub.add_parser("register", help="register edges' public keys with a SuperLink (--enable-supernode-auth)")
    r.add_argument("public_keys", nargs="+", metavar="PUB", help="OpenSSH public key files; name = file name "
                   "without .pub")
    r.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink host:port (default: %(default)s)")
    r.add_argument("--root-certificates", required=True, help="CA file that signed the SuperLink's certificate")
    r.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the SuperLink (default: 60)")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_flower()
    if args.command == "make":
        paths = make_certs(args.out, args.edges, args.san, args.days)
        print(f"certs: CA {paths['ca']}; SuperLink {paths['superlink_cert']} + {paths['superlink_key']}")
        for name in args.edges:
            print(f"certs: {name}: private key {paths[name]}, public key {paths[name]}.pub")
        return 0
    for name, (node_id, new) in register_nodes(args.superlink, args.root_certificates, args.public_keys,
                                               args.wait).items():
        print(f"register: {name}: node {node_id} " + ("registered" if new else "was already registered"),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
