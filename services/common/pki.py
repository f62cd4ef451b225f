"""A local certificate authority, one certificate per workload role and one per instance, for
the mesh's mTLS.

`make up` (the launcher) and compose (`certs-init`) call `ensure_pki(dir)` on every start: what is
there already is kept, what is missing, expiring or from another CA is made, so the first start
creates the CA and the certificates and later starts change nothing until a certificate nears the
end of its lifetime (`LEAF_DAYS`). Private keys are written 0600.

Layout of the directory (docs/security.md):
    ca.pem                the CA certificate every process trusts
    ca.key                the CA's private key (only this tool reads it; `ca_key` may put it elsewhere)
    <role>.pem <role>.key one certificate per role: CN and SAN DNS name = the role
    <role>/<id>.pem .key  one certificate per instance of a per-instance role (workers, host
                          caches): CN and SAN DNS name = the role, as above, and a SAN URI
                          spiffe://blitzmesh/<role>/<id> naming the instance (`spiffe_id`)
    own/tls.crt tls.key ca.crt  the same, for an instance whose certificate a per-pod issuer
                          writes under fixed names (cert-manager's csi-driver; docs/deploy.md)
    dataplane.key         the data plane's shared secret (services/dataplane/auth.py)

`renew(dir)` (`blitzmesh certs rotate`) issues every certificate there again, in place, with the
CA there: the running processes pick the new files up without a restart (docs/security.md).

Usage: python -m services.common.pki DIR [--ca-key PATH] [--instance ROLE/ID ...] [--days N] [--k8s-secret NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from services.common.roles import ADMIN, ALL_ROLES, INSTANCE_ROLES

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
DATAPLANE_KEY = "dataplane.key"
CA_NAME = "blitzmesh local CA"
CA_DAYS = 3650
# A leaf certificate's lifetime; ensure_pki issues a new one once less than a third of it is left.
LEAF_DAYS = 30
TRUST_DOMAIN = "blitzmesh"
# A per-pod issuer (cert-manager's csi-driver) cannot put the instance id into a file name: it
# writes the pod's certificate, key and CA under these fixed names, and the certificate's SAN URI
# says whose it is (load_identity checks that it names the instance).
OWN_DIR = "own"
OWN_CERT, OWN_KEY, OWN_CA = "tls.crt", "tls.key", "ca.crt"


def spiffe_id(role: str, instance: str) -> str:
    """The SAN URI naming one instance, e.g. spiffe://blitzmesh/worker/worker-0."""
    return f"spiffe://{TRUST_DOMAIN}/{role}/{instance}"


def parse_spiffe_id(uri: str) -> tuple[str, str] | None:
    """(role, instance) of a `spiffe_id` URI; None for any other URI."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    role, sep, instance = uri.removeprefix(prefix).partition("/")
    if not sep or not role or not instance or "/" in instance:
        return None
    return role, instance


def check_instance_id(role: str, instance: str) -> None:
    """ValueError unless `instance` can name a certificate file and a URI path segment."""
    if role not in INSTANCE_ROLES:
        raise ValueError(f"role {role!r} has no per-instance certificates; those roles are {list(INSTANCE_ROLES)}")
    if not instance or not all(c.isalnum() or c in "-_." for c in instance) or instance.startswith("."):
        raise ValueError(f"instance id {instance!r} must be letters, digits, '-', '_' or '.' (not leading)")


def cert_path(tls_dir: Path, role: str, instance: str | None = None) -> Path:
    return tls_dir / f"{role}.pem" if instance is None else tls_dir / role / f"{instance}.pem"


def key_path(tls_dir: Path, role: str, instance: str | None = None) -> Path:
    return tls_dir / f"{role}.key" if instance is None else tls_dir / role / f"{instance}.key"


def instance_files(
    tls_dir: Path, role: str, instance: str, *, exists: Callable[[Path], bool] = Path.exists
) -> tuple[Path, Path, Path]:
    """(CA, certificate, key) an instance presents: its own files `<role>/<id>.pem|.key` beside
    the CA, or, where only a per-pod issuer's `own/` directory is there, that directory's.
    (`exists`: services/mesh/chart.py asks of a pod's rendered volumes instead of the disk.)"""
    named = (tls_dir / CA_CERT, cert_path(tls_dir, role, instance), key_path(tls_dir, role, instance))
    own = tls_dir / OWN_DIR
    if exists(named[1]) or not exists(own / OWN_CERT):
        return named
    return own / OWN_CA, own / OWN_CERT, own / OWN_KEY


def secret_key(role: str, instance: str, suffix: str) -> str:
    """The key of `<role>/<id><suffix>` in a Kubernetes Secret, whose keys hold no '/':
    `<role>.<id><suffix>` (the Helm chart's Secret mode, docs/deploy.md)."""
    return f"{role}.{instance}{suffix}"


def named_instances(cert_pem: bytes) -> list[tuple[str, str]]:
    """(role, instance) of every `spiffe_id` SAN URI of a PEM certificate."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    named = (parse_spiffe_id(uri) for uri in san.get_values_for_type(x509.UniformResourceIdentifier))
    return [n for n in named if n is not None]


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by the owner only (0600), atomically (no half-written key is read)."""
    _staged_private(path, data).replace(path)


def _staged_private(path: Path, data: bytes) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_pair(cert_file: Path, key_file: Path, cert_pem: bytes, key_pem: bytes) -> None:
    """Replace a certificate and its key, each file atomically: both are written beside, then
    renamed into place, the certificate last. A reader sees the old pair, the new pair, or
    (between the two renames) the new key with the old certificate, never a half-written file;
    readers check that the two belong together and read again if not
    (services/common/security.py's `key_matches`)."""
    cert_file.parent.mkdir(parents=True, exist_ok=True)
    staged_key = _staged_private(key_file, key_pem)
    staged_cert = cert_file.with_name(cert_file.name + ".tmp")
    staged_cert.write_bytes(cert_pem)
    staged_key.replace(key_file)
    staged_cert.replace(cert_file)


def leaf_certificates(tls_dir: Path) -> list[tuple[str, str | None]]:
    """(role, instance or None) of every role and instance certificate in `tls_dir` (not the
    CA's, not a per-pod issuer's `own/`)."""
    found: list[tuple[str, str | None]] = [(role, None) for role in ALL_ROLES if cert_path(tls_dir, role).is_file()]
    for role in INSTANCE_ROLES:
        if (tls_dir / role).is_dir():
            found += [(role, p.stem) for p in sorted((tls_dir / role).glob("*.pem"))]
    return found


def renew(tls_dir: Path, *, ca_key: Path | None = None, days: int = LEAF_DAYS) -> list[tuple[str, int]]:
    """Issue every certificate in `tls_dir` (`leaf_certificates`) again, with a new key, signed by
    the CA there, valid for `days`; each pair is replaced with `write_pair`. Returns (file, new
    serial) per certificate. The CA stays: every process keeps trusting every other."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    ca_key_file = ca_key if ca_key is not None else tls_dir / CA_KEY
    try:
        ca_cert = x509.load_pem_x509_certificate((tls_dir / CA_CERT).read_bytes())
        ca_private = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
    except OSError as e:
        raise ValueError(
            f"cannot read the mesh CA ({str(e.filename)!r}: {e.strerror}); renew needs {CA_CERT} in {str(tls_dir)!r} "
            "and the CA key (--ca-key, default DIR/ca.key)"
        ) from e
    if not isinstance(ca_private, ec.EllipticCurvePrivateKey):
        raise ValueError(f"CA key {str(ca_key_file)!r} is not an EC private key")
    leaves = leaf_certificates(tls_dir)
    if not leaves:
        raise ValueError(f"no certificates to renew in {str(tls_dir)!r} (make up makes them on its first start)")
    renewed: list[tuple[str, int]] = []
    for role, instance in leaves:
        if instance is not None:
            check_instance_id(role, instance)
        cert_pem, key_pem = issue(ca_cert, ca_private, role, instance=instance, days=days)
        cert_file = cert_path(tls_dir, role, instance)
        write_pair(cert_file, key_path(tls_dir, role, instance), cert_pem, key_pem)
        serial = x509.load_pem_x509_certificate(cert_pem).serial_number
        renewed.append((str(cert_file.relative_to(tls_dir)), serial))
    return renewed


def ensure_pki(
    tls_dir: Path,
    roles: tuple[str, ...] = ALL_ROLES,
    *,
    ca_key: Path | None = None,
    instances: Iterable[tuple[str, str]] = (),
    days: int = LEAF_DAYS,
) -> list[str]:
    """Create what is missing in `tls_dir`: the CA, a certificate per role and per (role,
    instance id) of `instances`, the data plane key.

    Returns the names of the files made (empty when everything was there). A certificate is
    issued again when it is missing, not signed by the CA there now, or has less than a third
    of `days` left; a CA made anew re-issues them all, so no certificate of an older CA is left.
    """
    wanted: list[tuple[str, str | None]] = [(role, None) for role in roles]
    for role, instance in instances:
        check_instance_id(role, instance)
        wanted.append((role, instance))
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tls_dir.mkdir(parents=True, exist_ok=True)
    ca_key_file = ca_key if ca_key is not None else tls_dir / CA_KEY
    ca_key_file.parent.mkdir(parents=True, exist_ok=True)
    made: list[str] = []
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM

    def private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    new_ca = not (tls_dir / CA_CERT).exists() or not ca_key_file.exists()
    if new_ca:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(key, hashes.SHA256())
        )
        write_private(ca_key_file, private_pem(key))
        _write_public(tls_dir / CA_CERT, ca_cert.public_bytes(pem))
        made += [CA_CERT, str(ca_key_file)]
    ca_cert = x509.load_pem_x509_certificate((tls_dir / CA_CERT).read_bytes())
    loaded = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise SystemExit(f"CA key {str(ca_key_file)!r} is not an EC private key; move it away to make a new CA")
    ca_private = loaded

    renew_at = now + datetime.timedelta(days=days / 3)
    for role, instance in wanted:
        cert_file, key_file = cert_path(tls_dir, role, instance), key_path(tls_dir, role, instance)
        if not new_ca and key_file.exists() and _current(cert_file, ca_cert, renew_at):
            continue
        cert_pem, key_pem = issue(ca_cert, ca_private, role, instance=instance, days=days)
        write_pair(cert_file, key_file, cert_pem, key_pem)
        made += [str(f.relative_to(tls_dir)) for f in (cert_file, key_file)]

    if not (tls_dir / DATAPLANE_KEY).exists():
        write_private(tls_dir / DATAPLANE_KEY, secrets.token_hex(32).encode() + b"\n")
        made.append(DATAPLANE_KEY)
    return made


def _current(cert_file: Path, ca_cert: Any, renew_at: datetime.datetime) -> bool:
    """Whether `cert_file` exists, was issued by `ca_cert` and is valid past `renew_at`."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return False
    return cert.not_valid_after_utc > renew_at


def issue(
    ca_cert: Any, ca_key: Any, name: str, *, instance: str | None = None, days: int = LEAF_DAYS
) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) for `name` (CN and SAN DNS name), signed by the CA,
    valid for `days`; with `instance`, a SAN URI `spiffe_id(name, instance)` names it too."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(name)]
                + ([x509.UniformResourceIdentifier(spiffe_id(name, instance))] if instance is not None else [])
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def issue_from(
    tls_dir: Path, name: str, *, ca_key: Path | None = None, instance: str | None = None, days: int = LEAF_DAYS
) -> tuple[bytes, bytes]:
    """`issue()` with the CA in `tls_dir` (an operator's extra certificate, the security tests')."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate((tls_dir / CA_CERT).read_bytes())
    key = serialization.load_pem_private_key((ca_key or tls_dir / CA_KEY).read_bytes(), password=None)
    return issue(ca_cert, key, name, instance=instance, days=days)


def secret_manifest(tls_dir: Path, name: str, *, ca_key: Path | None = None) -> dict[str, Any]:
    """A Kubernetes Secret `name` holding what the Helm chart's Secret mode mounts from `tls_dir`:
    ca.pem, dataplane.key, the certificate and key of each role a pod runs as one of (not the
    per-instance roles' shared ones, not the admin's), each instance's `<role>/<id>.pem` and
    `.key` under `secret_key`. Never a private key of the CA."""
    import base64

    wanted = {CA_CERT, DATAPLANE_KEY} | {
        p.name
        for role in ALL_ROLES
        if role not in INSTANCE_ROLES and role != ADMIN
        for p in (cert_path(tls_dir, role), key_path(tls_dir, role))
    }
    data: dict[str, str] = {}
    for path in sorted(tls_dir.iterdir()):
        if path.is_file() and path.name in wanted and (ca_key is None or path.resolve() != ca_key.resolve()):
            data[path.name] = base64.b64encode(path.read_bytes()).decode()
        elif path.is_dir() and path.name in INSTANCE_ROLES:
            for f in sorted(path.iterdir()):
                if f.suffix in (".pem", ".key"):
                    data[secret_key(path.name, f.stem, f.suffix)] = base64.b64encode(f.read_bytes()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque", "data": data}


def read_key(path: Path) -> bytes:
    """The data plane key in `path` (hex); SystemExit naming the file and how to make it."""
    try:
        text = path.read_text().strip()
        key = bytes.fromhex(text)
    except OSError as e:
        raise SystemExit(
            f"data plane key {str(path)!r} cannot be read ({e.strerror}); create it with "
            f"`python -m services.common.pki {path.parent}`, or pass --insecure for a development mesh"
        ) from e
    except ValueError as e:
        raise SystemExit(f"data plane key {str(path)!r} is not hex: {e}") from e
    if len(key) < 16:
        raise SystemExit(f"data plane key {str(path)!r} has {len(key)} bytes; want at least 16")
    return key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.common.pki", description=__doc__.split("\n\n")[0])
    p.add_argument("tls_dir", type=Path, help="where the CA, the certificates and the keys go")
    p.add_argument("--ca-key", type=Path, default=None, help="keep the CA's private key here (default DIR/ca.key)")
    p.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="ROLE/ID",
        help=f"also a certificate for this instance, e.g. worker/worker-0 (roles {list(INSTANCE_ROLES)}); repeatable",
    )
    p.add_argument("--days", type=int, default=LEAF_DAYS, help="lifetime of the certificates issued (days)")
    p.add_argument(
        "--k8s-secret",
        metavar="NAME",
        default=None,
        help="then print a Kubernetes Secret NAME (JSON, for kubectl apply -f -) holding DIR's files as the Helm "
        "chart's tls.secretName wants them: <role>/<id>.pem as key <role>.<id>.pem; never the CA key",
    )
    args = p.parse_args(argv)
    instances = []
    for spec in args.instance:
        role, sep, instance = spec.partition("/")
        if not sep:
            p.error(f"--instance {spec!r}: want ROLE/ID, e.g. worker/worker-0")
        instances.append((role, instance))
    try:
        made = ensure_pki(args.tls_dir, ca_key=args.ca_key, instances=instances, days=args.days)
    except ValueError as e:
        p.error(str(e))
    print(f"{args.tls_dir}: " + (f"made {', '.join(made)}" if made else "all present, nothing made"), file=sys.stderr)
    if args.k8s_secret is not None:
        print(json.dumps(secret_manifest(args.tls_dir, args.k8s_secret, ca_key=args.ca_key), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
