"""The control plane's own PKI, written as PEM files, and the admin kubeconfig.

One throwaway CA signs the kube-apiserver serving certificate (SANs for every
name and loopback address a client may use) and an admin client certificate in
``system:masters``; a separate RSA key pair signs service-account tokens. Keys are
ECDSA P-256 (fast to generate); the SA key is RSA because the token signer
expects RS256 by default. This is test PKI: short-lived, unencrypted keys,
nothing here is fit to protect a real cluster.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Certificates live a week: long enough for a dev session, short enough to be obviously throwaway.
VALIDITY = dt.timedelta(days=7)
APISERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True, slots=True)
class PKIFiles:
    """Paths of the PEM files under one directory: ``ca_crt`` is ``dir / "ca.crt"``, and so on."""

    dir: Path
    ca_crt: Path = field(init=False)
    ca_key: Path = field(init=False)
    apiserver_crt: Path = field(init=False)
    apiserver_key: Path = field(init=False)
    admin_crt: Path = field(init=False)
    admin_key: Path = field(init=False)
    sa_key: Path = field(init=False)
    sa_pub: Path = field(init=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if not f.init:  # frozen: set once here, through object's own __setattr__
                object.__setattr__(self, f.name, self.dir / f.name.replace("_", "."))


# KeyUsage names every bit; these are never set here.
_UNUSED_KEY_USAGES = ("content_commitment", "data_encipherment", "key_agreement", "encipher_only", "decipher_only")


def _key_usage(is_ca: bool) -> x509.KeyUsage:
    """A CA signs certificates and CRLs; a leaf signs and enciphers keys (TLS)."""
    return x509.KeyUsage(
        digital_signature=True,
        key_encipherment=not is_ca,
        key_cert_sign=is_ca,
        crl_sign=is_ca,
        **dict.fromkeys(_UNUSED_KEY_USAGES, False),
    )


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _sign(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    ca_cert: x509.Certificate | None,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    is_ca: bool = False,
    usages: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer = ca_cert.subject if ca_cert is not None else subject
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(_key_usage(is_ca), critical=True)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def create_pki(directory: Path, extra_ips: tuple[str, ...] = ("127.2.0.1",)) -> PKIFiles:
    """Write a fresh CA, apiserver serving cert, admin client cert and SA key pair.

    ``extra_ips`` are added to the apiserver's SANs besides 127.0.0.1: the first
    address of the service range, which is the ``kubernetes`` Service's ClusterIP.
    """
    directory.mkdir(parents=True, exist_ok=True)
    files = PKIFiles(directory)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plimsoll-dev-ca")])
    ca_cert = _sign(ca_name, ca_key.public_key(), None, ca_key, is_ca=True)
    _write(files.ca_key, _key_pem(ca_key), private=True)
    _write(files.ca_crt, ca_cert.public_bytes(serialization.Encoding.PEM))

    srv_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in APISERVER_DNS]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *extra_ips)]
    srv_cert = _sign(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        srv_key.public_key(),
        ca_cert,
        ca_key,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=sans,
    )
    _write(files.apiserver_key, _key_pem(srv_key), private=True)
    _write(files.apiserver_crt, srv_cert.public_bytes(serialization.Encoding.PEM))

    # O=system:masters is bound to cluster-admin by the bootstrap RBAC policy.
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin_cert = _sign(
        x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                x509.NameAttribute(NameOID.COMMON_NAME, "admin"),
            ]
        ),
        admin_key.public_key(),
        ca_cert,
        ca_key,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    _write(files.admin_key, _key_pem(admin_key), private=True)
    _write(files.admin_crt, admin_cert.public_bytes(serialization.Encoding.PEM))

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write(files.sa_key, _key_pem(sa_key), private=True)
    _write(
        files.sa_pub,
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    return files


def write_kubeconfig(path: Path, files: PKIFiles, server: str, name: str = "plimsoll-dev") -> Path:
    """An admin kubeconfig with the certificates embedded, so it works from any directory."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority-data": b64(files.ca_crt)}}
        ],
        "users": [
            {
                "name": f"{name}-admin",
                "user": {
                    "client-certificate-data": b64(files.admin_crt),
                    "client-key-data": b64(files.admin_key),
                },
            }
        ],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": f"{name}-admin", "namespace": "default"}}
        ],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
