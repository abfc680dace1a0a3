"""The control plane's PKI: a chain that verifies, the SANs clients use, an admin in system:masters."""

import ipaddress
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from plimsoll.devcluster.pki import create_pki, write_kubeconfig


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certificates_chain_to_the_ca_with_the_right_names(tmp_path: Path) -> None:
    files = create_pki(tmp_path / "pki", extra_ips=("127.2.0.1",))
    ca, srv, admin = _load(files.ca_crt), _load(files.apiserver_crt), _load(files.admin_crt)
    for cert in (srv, admin):
        cert.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong

    sans = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "kubernetes.default.svc"} <= set(sans.get_values_for_type(x509.DNSName))
    ips = set(sans.get_values_for_type(x509.IPAddress))
    assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("127.2.0.1")} <= ips
    assert all(ip.is_loopback for ip in ips)
    assert (
        ExtendedKeyUsageOID.SERVER_AUTH in srv.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )

    orgs = [a.value for a in admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]
    assert (
        ExtendedKeyUsageOID.CLIENT_AUTH
        in admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )
    assert files.sa_key.stat().st_mode & 0o077 == 0, "private keys must not be world-readable"


def test_kubeconfig_embeds_the_credentials(tmp_path: Path) -> None:
    files = create_pki(tmp_path / "pki")
    path = write_kubeconfig(tmp_path / "kc", files, "https://127.0.0.1:6443")
    config = yaml.safe_load(path.read_text())
    ctx = config["current-context"]
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert config["users"][0]["user"]["client-certificate-data"]
    assert ctx == config["contexts"][0]["name"]
