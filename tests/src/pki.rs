//! Certificates for the mTLS tests and `loadgen --mtls`, made here with rcgen: a CA and the
//! leaf certificates it signs (ECDSA P-256, server and client use), written as PEM files the
//! way cert-manager and SPIRE leave them.

use std::net::IpAddr;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use sha2::Digest as _;

/// A certificate authority.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
}

/// How long a leaf certificate is valid.
#[derive(Debug, Clone, Copy)]
pub enum Validity {
    /// From 2020 until the given date (year, month, day).
    Until(i32, u8, u8),
    /// From 2020 to 2021: expired.
    Expired,
}

/// A leaf certificate and its key.
pub struct Leaf {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM (PKCS#8).
    pub key_pem: String,
    /// The certificate, DER.
    pub der: Vec<u8>,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("a P-256 key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("empty SANs");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2090, 1, 1);
        let cert = params.self_signed(&key).expect("a self-signed CA");
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf certificate for `names`: `spiffe://…` become URI SANs, addresses IP SANs, the rest
    /// DNS SANs.
    pub fn issue(&self, names: &[&str], validity: Validity) -> Leaf {
        let key = KeyPair::generate().expect("a P-256 key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("empty SANs");
        params.subject_alt_names = names
            .iter()
            .map(|name| {
                if name.starts_with("spiffe://") {
                    SanType::URI((*name).try_into().expect("an IA5 URI"))
                } else if let Ok(ip) = name.parse::<IpAddr>() {
                    SanType::IpAddress(ip)
                } else {
                    SanType::DnsName((*name).try_into().expect("an IA5 DNS name"))
                }
            })
            .collect();
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("leaf"));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = match validity {
            Validity::Until(y, m, d) => rcgen::date_time_ymd(y, m, d),
            Validity::Expired => rcgen::date_time_ymd(2021, 1, 1),
        };
        let cert = params.signed_by(&key, &self.issuer).expect("the CA signs");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    /// Writes the CA certificate to `path` (atomically, as [`Leaf::write`]).
    pub fn write(&self, path: &Path) {
        replace(path, &self.pem);
    }
}

impl Leaf {
    /// SHA-256 of the DER certificate, lowercase hex (what ListAgents shows).
    pub fn sha256(&self) -> String {
        hex::encode(sha2::Sha256::digest(&self.der))
    }

    /// Writes the certificate and key, each by writing a temporary file and renaming it over
    /// the old one, the way cert-manager's and SPIRE's helpers replace them.
    pub fn write(&self, cert: &Path, key: &Path) {
        replace(key, &self.key_pem);
        replace(cert, &self.cert_pem);
    }
}

fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write a PEM file");
    std::fs::rename(&tmp, path).expect("rename it into place");
}
