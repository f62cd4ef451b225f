"""The mesh's PKI, its table of permissions and the data plane's peer check, in one process."""

from __future__ import annotations

import asyncio
import io
import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from google.protobuf import descriptor_pool

import blitzmesh.v1.global_manager_pb2
import blitzmesh.v1.param_manager_pb2
import blitzmesh.v1.worker_pb2  # noqa: F401  (registers the services' descriptors)
from blitzmesh import cli
from services.common import pki, roles, security
from services.common.pki import read_key
from services.common.security import key_matches, load_identity
from services.dataplane.auth import AuthenticatedTransport
from services.dataplane.errors import PeerClosed, ProtocolError, TransferTimeout
from services.dataplane.tcp import TcpTransport

INTERNAL_SERVICES = ("blitzmesh.v1.GlobalManager", "blitzmesh.v1.Worker", "blitzmesh.v1.ParamManager")


def test_pki_is_made_once_with_private_keys_0600(tmp_path: Path) -> None:
    made = pki.ensure_pki(tmp_path / "tls")
    assert "ca.pem" in made and "worker.pem" in made and "dataplane.key" in made
    for path in (tmp_path / "tls").iterdir():
        if path.suffix == ".key":
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    before = {p.name: p.read_bytes() for p in (tmp_path / "tls").iterdir()}
    assert pki.ensure_pki(tmp_path / "tls") == []  # idempotent: the second start makes nothing
    assert {p.name: p.read_bytes() for p in (tmp_path / "tls").iterdir()} == before


def test_a_lost_role_certificate_is_made_again_and_a_new_ca_reissues_all(tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    pki.ensure_pki(tls)
    (tls / "gateway.pem").unlink()
    assert pki.ensure_pki(tls) == ["gateway.pem", "gateway.key"]
    old_worker = (tls / "worker.pem").read_bytes()
    (tls / "ca.key").unlink()
    made = pki.ensure_pki(tls)
    assert "ca.pem" in made and (tls / "worker.pem").read_bytes() != old_worker


def test_certificates_name_their_role(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    pki.ensure_pki(tmp_path)
    for role in roles.ALL_ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / f"{role}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [role]


def test_an_instance_certificate_names_its_role_and_its_instance_for_thirty_days(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    made = pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "worker-0"), (roles.HOST_CACHE, "host-cache-1")])
    assert "worker/worker-0.pem" in made and "host-cache/host-cache-1.key" in made
    assert stat.S_IMODE((tmp_path / "worker" / "worker-0.key").stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((tmp_path / "worker" / "worker-0.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == roles.WORKER
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [roles.WORKER]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://blitzmesh/worker/worker-0"]
    assert pki.parse_spiffe_id("spiffe://blitzmesh/worker/worker-0") == (roles.WORKER, "worker-0")
    assert pki.parse_spiffe_id("spiffe://other/worker/worker-0") is None
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime.days == pki.LEAF_DAYS == 30  # (plus the 5 minutes of clock skew allowed)
    identity = load_identity(tmp_path, roles.WORKER, "worker-0")
    assert identity.instance == "worker-0" and identity.cert_pem == cert.public_bytes(serialization.Encoding.PEM)


def test_a_certificate_near_its_end_or_from_another_ca_is_issued_again(tmp_path: Path) -> None:
    pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "worker-0")])
    assert pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "worker-0")]) == []
    # Nine days left of a thirty-day certificate: less than a third, so the next start renews it.
    cert, key = pki.issue_from(tmp_path, roles.WORKER, instance="worker-0", days=9)
    (tmp_path / "worker" / "worker-0.pem").write_bytes(cert)
    assert pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "worker-0")]) == [
        "worker/worker-0.pem",
        "worker/worker-0.key",
    ]
    # A gateway certificate some other CA signed.
    other = tmp_path / "other"
    pki.ensure_pki(other, (roles.GATEWAY,))
    (tmp_path / "gateway.pem").write_bytes((other / "gateway.pem").read_bytes())
    assert pki.ensure_pki(tmp_path) == ["gateway.pem", "gateway.key"]


@pytest.mark.parametrize(
    ("role", "instance", "why"),
    [
        (roles.GATEWAY, "gw-0", "no per-instance certificates"),
        (roles.WORKER, "../ca", "must be letters"),
        (roles.WORKER, "", "must be letters"),
        (roles.WORKER, "a/b", "must be letters"),
    ],
)
def test_an_instance_id_that_cannot_name_a_certificate_is_refused(
    tmp_path: Path, role: str, instance: str, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        pki.ensure_pki(tmp_path, instances=[(role, instance)])


def test_missing_instance_certificate_says_how_to_make_it(tmp_path: Path) -> None:
    pki.ensure_pki(tmp_path)
    with pytest.raises(SystemExit) as e:
        load_identity(tmp_path, roles.WORKER, "worker-7")
    assert str(tmp_path / "worker" / "worker-7.pem") in str(e.value)
    assert f"python -m services.common.pki {tmp_path} --instance worker/worker-7" in str(e.value)


def test_an_instance_presents_a_per_pod_issuer_s_certificate_only_if_it_names_the_instance(tmp_path: Path) -> None:
    """cert-manager's csi-driver writes a pod's certificate under fixed names (own/tls.crt, as
    the Helm chart mounts it); a certificate for another instance fails at start, not at
    registration."""
    pki.ensure_pki(tmp_path, (roles.WORKER,))
    own = tmp_path / pki.OWN_DIR
    own.mkdir()
    cert, key = pki.issue_from(tmp_path, roles.WORKER, instance="pod-3")
    (own / pki.OWN_CERT).write_bytes(cert)
    (own / pki.OWN_KEY).write_bytes(key)
    (own / pki.OWN_CA).write_bytes((tmp_path / "ca.pem").read_bytes())
    identity = load_identity(tmp_path, roles.WORKER, "pod-3")
    assert identity.cert_pem == cert and identity.key_pem == key
    with pytest.raises(SystemExit, match="names \\['spiffe://blitzmesh/worker/pod-3'\\], not this process's"):
        load_identity(tmp_path, roles.WORKER, "pod-4")
    # The file named for the instance wins over own/, and must name it too.
    pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "pod-4")])
    assert load_identity(tmp_path, roles.WORKER, "pod-4").cert_pem == (tmp_path / "worker" / "pod-4.pem").read_bytes()
    (tmp_path / "worker" / "pod-4.pem").write_bytes(cert)
    with pytest.raises(SystemExit, match="not this process's 'spiffe://blitzmesh/worker/pod-4'"):
        load_identity(tmp_path, roles.WORKER, "pod-4")


def test_the_helm_secret_holds_each_instance_s_files_and_no_ca_key(tmp_path: Path) -> None:
    import base64

    pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "blitzmesh-worker-0"), (roles.HOST_CACHE, "host-cache-1")])
    secret = pki.secret_manifest(tmp_path, "blitzmesh-tls")
    assert secret["metadata"] == {"name": "blitzmesh-tls"} and secret["kind"] == "Secret"
    assert sorted(secret["data"]) == [
        "ca.pem",
        "dataplane.key",
        "gateway.key",
        "gateway.pem",
        "global-manager.key",
        "global-manager.pem",
        "host-cache.host-cache-1.key",
        "host-cache.host-cache-1.pem",
        "param-manager.key",
        "param-manager.pem",
        "worker.blitzmesh-worker-0.key",
        "worker.blitzmesh-worker-0.pem",
    ]
    key = pki.secret_key(roles.WORKER, "blitzmesh-worker-0", ".key")
    assert base64.b64decode(secret["data"][key]) == (tmp_path / "worker" / "blitzmesh-worker-0.key").read_bytes()


def test_missing_certificate_names_the_path_and_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        load_identity(tmp_path, roles.WORKER)
    assert str(tmp_path / "ca.pem") in str(e.value)
    assert "python -m services.common.pki" in str(e.value) and "--insecure" in str(e.value)
    with pytest.raises(SystemExit, match="unknown workload role 'root'"):
        load_identity(tmp_path, "root")


def test_every_method_of_every_internal_service_has_a_row() -> None:
    """A method missing from the table is refused to everyone: a new RPC must be given its
    roles (services/common/roles.py) or nobody can call it."""
    pool = descriptor_pool.Default()
    for name in INTERNAL_SERVICES:
        methods = {m.name for m in pool.FindServiceByName(name).methods}
        assert set(roles.PERMISSIONS[name]) == methods, name
        for method, allowed in roles.PERMISSIONS[name].items():
            assert allowed and allowed <= set(roles.ALL_ROLES), (name, method)


def test_the_issue_rules_hold() -> None:
    for method in ("LoadParameters", "Drain", "Resume", "Unload"):
        assert roles.allowed_roles(f"/blitzmesh.v1.Worker/{method}") == {roles.GLOBAL_MANAGER}
    for method in ("RegisterInstance", "Heartbeat"):
        assert roles.allowed_roles(f"/blitzmesh.v1.GlobalManager/{method}") == {roles.WORKER}
    assert roles.GATEWAY in roles.allowed_roles("/blitzmesh.v1.Worker/Generate")
    assert roles.ADMIN not in roles.allowed_roles("/blitzmesh.v1.Worker/Generate")
    assert roles.allowed_roles("/blitzmesh.v1.Worker/NoSuchMethod") == frozenset()
    assert roles.allowed_roles("/no.Such/Service") == frozenset()


async def _pair(
    server_key: bytes | None, client_key: bytes | None
) -> tuple[TcpTransport | AuthenticatedTransport, TcpTransport | AuthenticatedTransport]:
    server: TcpTransport | AuthenticatedTransport = TcpTransport()
    client: TcpTransport | AuthenticatedTransport = TcpTransport()
    if server_key is not None:
        server = AuthenticatedTransport(server, server_key, timeout_s=1.0)
    if client_key is not None:
        client = AuthenticatedTransport(client, client_key, timeout_s=1.0)
    await server.start()
    await client.start()
    return server, client


async def test_dataplane_peers_with_the_key_talk() -> None:
    key = b"k" * 32
    server, client = await _pair(key, key)
    try:
        ep = await client.connect(server.address(), timeout_s=5)
        theirs = await server.accept(timeout_s=5)
        await ep.send_msg(b"hello", 7, timeout_s=5)
        assert await theirs.recv_msg(7, timeout_s=5) == b"hello"
    finally:
        await client.close()
        await server.close()


@pytest.mark.parametrize("client_key", [b"x" * 32, None], ids=["wrong-key", "no-key"])
async def test_dataplane_refuses_a_peer_without_the_key(client_key: bytes | None) -> None:
    server, client = await _pair(b"k" * 32, client_key)
    try:
        ep = await client.connect(server.address(), timeout_s=5)
        if client_key is not None:
            pytest.fail(f"the connect should have failed, got {ep}")
    except (PeerClosed, TransferTimeout, ProtocolError):
        pass
    try:
        if client_key is None:
            # A stranger that skips the handshake and sends a request is never handed up.
            await ep.send_msg(b'{"op": "pull"}', 0, timeout_s=1)
        with pytest.raises(TransferTimeout):
            await server.accept(timeout_s=1.5)
        assert isinstance(server, AuthenticatedTransport) and server.refused == 1
    finally:
        await client.close()
        await server.close()


async def test_dataplane_connector_refuses_a_stranger_acceptor() -> None:
    """The check is mutual: a process posing as a source without the key is refused too."""
    server, client = await _pair(b"x" * 32, b"k" * 32)
    try:
        with pytest.raises((ProtocolError, PeerClosed, TransferTimeout)):
            await client.connect(server.address(), timeout_s=5)
    finally:
        await client.close()
        await server.close()


async def test_a_silent_peer_does_not_hold_up_the_others() -> None:
    key = b"k" * 32
    server, client = await _pair(key, key)
    silent = TcpTransport()
    await silent.start()
    try:
        _ = await silent.connect(server.address(), timeout_s=5)  # never answers the challenge
        await asyncio.sleep(0.05)
        await client.connect(server.address(), timeout_s=5)
        await server.accept(timeout_s=0.5)  # handed up while the silent one still waits
    finally:
        await silent.close()
        await client.close()
        await server.close()


def test_read_key_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="python -m services.common.pki"):
        read_key(tmp_path / "dataplane.key")
    (tmp_path / "dataplane.key").write_text("zz")
    with pytest.raises(SystemExit, match="not hex"):
        read_key(tmp_path / "dataplane.key")


def test_make_up_runs_mtls_unless_told_insecure(tmp_path: Path) -> None:
    from services.mesh.__main__ import parse_args
    from services.mesh.launcher import MeshConfig, role_of

    cfg = parse_args(["--run-dir", str(tmp_path)])
    assert not cfg.insecure and cfg.security_args() == ["--tls-dir", str((tmp_path / "tls").resolve())]
    assert parse_args(["--insecure"]).security_args() == ["--insecure"]
    assert parse_args(["--tls-dir", str(tmp_path / "pki")]).tls_path == tmp_path / "pki"
    assert MeshConfig().security_args()[0] == "--tls-dir"  # meshes built in code too
    assert [role_of(n) for n in ("gateway", "global_manager", "worker-3", "param_manager", "host_cache-1")] == [
        roles.GATEWAY,
        roles.GLOBAL_MANAGER,
        roles.WORKER,
        roles.PARAM_MANAGER,
        roles.HOST_CACHE,
    ]


def test_certs_rotate_renews_every_certificate_in_place_with_the_same_ca(tmp_path: Path) -> None:
    pki.ensure_pki(tmp_path, instances=[(roles.WORKER, "worker-0"), (roles.HOST_CACHE, "host-cache-1")])
    ca_before = (tmp_path / pki.CA_CERT).read_bytes()
    leaves = pki.leaf_certificates(tmp_path)
    assert len(leaves) == len(roles.ALL_ROLES) + 2
    before = {leaf: pki.cert_path(tmp_path, *leaf).read_bytes() for leaf in leaves}

    out = io.StringIO()
    assert cli.main(["certs", "rotate", "--tls-dir", str(tmp_path), "--json"], out) == 0
    printed = {row["certificate"]: int(row["serial"], 16) for row in json.loads(out.getvalue())}

    assert (tmp_path / pki.CA_CERT).read_bytes() == ca_before
    ca = x509.load_pem_x509_certificate(ca_before)
    for leaf in leaves:
        cert_pem = pki.cert_path(tmp_path, *leaf).read_bytes()
        cert = x509.load_pem_x509_certificate(cert_pem)
        assert cert_pem != before[leaf]
        cert.verify_directly_issued_by(ca)
        assert printed[str(pki.cert_path(tmp_path, *leaf).relative_to(tmp_path))] == cert.serial_number
        assert key_matches(cert_pem, pki.key_path(tmp_path, *leaf).read_bytes())
        assert stat.S_IMODE(pki.key_path(tmp_path, *leaf).stat().st_mode) == 0o600
    assert load_identity(tmp_path, roles.WORKER, "worker-0").instance == "worker-0"
    assert not list(tmp_path.rglob("*.tmp"))


def test_certs_rotate_without_a_ca_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["certs", "rotate", "--tls-dir", str(tmp_path)], io.StringIO()) == cli.EXIT_FAILED
    assert "ca.pem" in capsys.readouterr().err


def test_a_certificate_with_another_key_is_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pki.ensure_pki(tmp_path)
    _, other_key = pki.issue_from(tmp_path, roles.GATEWAY)
    pki.write_private(pki.key_path(tmp_path, roles.GATEWAY), other_key)
    monkeypatch.setattr(security, "_PAIR_WAIT_S", 0.1)
    with pytest.raises(SystemExit, match="do not belong together.*blitzmesh certs rotate"):
        load_identity(tmp_path, roles.GATEWAY)
