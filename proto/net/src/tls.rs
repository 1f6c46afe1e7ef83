//! Mutual TLS between the scheduler and agents, with certificates re-read when they are rotated.
//!
//! rustls on ring (no OpenSSL). Both sides present a certificate and verify the other's against
//! a CA bundle; each side may insist on the other's identity, a DNS SAN or a `spiffe://` URI
//! SAN. Files are checked (one `stat` each) on every new connection: when cert-manager or SPIRE
//! replace them, the next connection uses the new pair, with no restart. A replacement that does
//! not load (half written, key and certificate not matching) keeps the previous configuration
//! and logs an error naming the file.
//!
//! # The API
//!
//! - [`TlsFiles`]: one side's three PEM files: `cert` (the chain, leaf first), `key`, and `ca`
//!   (the CAs that sign the *other* side's certificates).
//! - [`Identity`]: what a peer certificate must carry, [`Identity::parse`]d from `spiffe://…`
//!   (a URI SAN) or a DNS name (a DNS SAN, wildcards as in web PKI).
//! - [`ServerTls::load`]`(files, require)`: a reloading acceptor. [`ServerTls::accept`]`(tcp)`
//!   completes a handshake that refuses every client without a certificate signed by `ca` (and
//!   carrying `require` when given), before a single byte of HTTP/2.
//! - [`ClientTls::load`]`(files, server_name)`: a reloading connector. [`ClientTls::connect`]
//!   does one handshake over a TCP stream; [`ClientTls::channel`] is a lazy tonic `Channel` whose
//!   every connection is TCP + TLS with the files of that moment. [`ClientTls::status`] tells
//!   the peer certificate of the last connection the server accepted, or why the last one
//!   failed.
//! - [`PeerCert::of`]: a certificate's SHA-256 fingerprint, expiry and names;
//!   [`peer_identity`]: the one name it is known by (its first `spiffe://` URI SAN, else its
//!   first DNS SAN); [`check_identity`]: does it carry this identity.
//! - [`TlsArgs`]: the agent flags (`--tls-cert`, `--tls-key`, `--tls-client-ca`,
//!   `--tls-require-identity`, `--insecure-plaintext`; `ANTIDOTE_AGENT_TLS_*`), for
//!   `#[command(flatten)]`. [`TlsArgs::listener`] turns a bound socket into a
//!   [`crate::Listener`] for the SDK's `run`, and refuses plaintext on an address other than
//!   loopback unless `--insecure-plaintext` says a service mesh does mTLS instead.
//! - [`describe`]: a handshake error as a sentence ("certificate signed by unknown authority").
//!
//! ALPN is `h2` on both sides: gRPC implementations in other languages insist on it.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    AlertDescription, CertificateError, DigitallySignedStruct, DistinguishedName, OtherError,
    RootCertStore, SignatureScheme,
};
use sha2::Digest as _;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Longest a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client waits for the server's first bytes (its verdict on our certificate, see
/// [`ClientTls::dial`]) before it starts writing anyway.
pub const FIRST_BYTES: Duration = Duration::from_secs(3);

/// A TLS problem: a file that does not load, a flag combination that makes no sense, or a
/// refused handshake. Messages name the file or flag.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A file was read but does not hold what it should.
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
    /// The files load, but not together (a key that does not match its certificate).
    #[error("{0}")]
    Config(String),
    /// An identity that is neither a DNS name nor a `spiffe://` URI.
    #[error("identity `{0}`: expected a DNS name or a spiffe:// URI")]
    Identity(String),
    /// Flags that contradict each other or the secure default.
    #[error("{0}")]
    Flags(String),
    /// The TCP connection could not be made.
    #[error("{0}")]
    Connect(String),
    /// The handshake failed; the reason is a sentence from [`describe`].
    #[error("TLS: {0}")]
    Handshake(String),
}

/// One side's certificate, key and the CAs it trusts for the other side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This side's certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// This side's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates (PEM) that sign the other side's certificates.
    pub ca: PathBuf,
}

impl TlsFiles {
    fn paths(&self) -> [&Path; 3] {
        [&self.cert, &self.key, &self.ca]
    }
}

/// An identity a peer certificate must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A DNS SAN (or an IP address SAN when the text is an address).
    Dns(String),
    /// A URI SAN: a SPIFFE id, `spiffe://trust-domain/path`.
    Uri(String),
}

impl Identity {
    /// `spiffe://…` is a URI SAN; anything else must be a DNS name or an IP address.
    pub fn parse(text: &str) -> Result<Identity, TlsError> {
        let text = text.trim();
        if text.starts_with("spiffe://") && text.len() > "spiffe://".len() {
            Ok(Identity::Uri(text.to_owned()))
        } else if !text.contains("://") && ServerName::try_from(text).is_ok() {
            Ok(Identity::Dns(text.to_owned()))
        } else {
            Err(TlsError::Identity(text.to_owned()))
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Dns(name) => write!(f, "DNS:{name}"),
            Identity::Uri(uri) => write!(f, "URI:{uri}"),
        }
    }
}

/// What operators want to know of a peer certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerCert {
    /// SHA-256 of the DER certificate, lowercase hex.
    pub sha256: String,
    /// Its notAfter (`None` only for a certificate whose validity cannot be read).
    pub not_after: Option<SystemTime>,
    /// Its SAN names, `DNS:…` and `URI:…`.
    pub names: Vec<String>,
}

impl PeerCert {
    /// Fingerprint, expiry and names of a DER certificate.
    pub fn of(cert: &CertificateDer<'_>) -> PeerCert {
        PeerCert {
            sha256: hex(&sha2::Sha256::digest(cert.as_ref())),
            not_after: not_after(cert.as_ref()),
            names: names(cert),
        }
    }
}

/// The name a certificate is known by: its first `spiffe://` URI SAN, else its first DNS SAN.
/// Call it on a certificate the handshake verified.
pub fn peer_identity(cert: &CertificateDer<'_>) -> Option<String> {
    let cert = webpki::EndEntityCert::try_from(cert).ok()?;
    let spiffe = cert
        .valid_uri_names()
        .find(|uri| uri.starts_with("spiffe://"))
        .map(str::to_owned);
    spiffe.or_else(|| cert.valid_dns_names().next().map(str::to_owned))
}

/// Whether `cert` carries `want`: a DNS SAN matching it (web PKI rules, wildcards included) or
/// exactly that URI SAN. The error is the one a handshake fails with, naming what the
/// certificate does carry.
pub fn check_identity(cert: &CertificateDer<'_>, want: &Identity) -> Result<(), rustls::Error> {
    let matches = match want {
        Identity::Dns(name) => {
            let parsed = ParsedCertificate::try_from(cert)?;
            let name = ServerName::try_from(name.as_str())
                .map_err(|_| rustls::Error::General(format!("bad DNS name `{name}`")))?;
            rustls::client::verify_server_name(&parsed, &name).is_ok()
        }
        Identity::Uri(uri) => webpki::EndEntityCert::try_from(cert)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?
            .valid_uri_names()
            .any(|presented| presented == uri),
    };
    if matches {
        Ok(())
    } else {
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            OtherError(Arc::new(IdentityMismatch {
                want: want.clone(),
                presented: names(cert),
            })),
        )))
    }
}

/// A verified certificate that does not carry the identity required.
#[derive(Debug)]
struct IdentityMismatch {
    want: Identity,
    presented: Vec<String>,
}

impl fmt::Display for IdentityMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let presented = if self.presented.is_empty() {
            "no DNS or URI name".to_owned()
        } else {
            self.presented.join(", ")
        };
        write!(
            f,
            "certificate is not valid for {} (it names {presented})",
            self.want
        )
    }
}

impl std::error::Error for IdentityMismatch {}

/// A handshake error as a short sentence for logs and operators.
pub fn describe(err: &rustls::Error) -> String {
    use rustls::Error as E;
    match err {
        E::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer => "certificate signed by unknown authority".into(),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "certificate has expired".into()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "certificate is not valid yet".into()
            }
            CertificateError::NotValidForName => "certificate is not valid for the name".into(),
            CertificateError::NotValidForNameContext {
                expected,
                presented,
            } => format!(
                "certificate is not valid for {expected:?} (it names {})",
                presented.join(", ")
            ),
            CertificateError::BadSignature => "certificate has a bad signature".into(),
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                "certificate is not meant for this use (extended key usage)".into()
            }
            CertificateError::Other(other) => other.to_string(),
            other => format!("bad certificate: {other:?}"),
        },
        E::NoCertificatesPresented => "no client certificate presented".into(),
        E::AlertReceived(alert) => format!(
            "the peer refused the handshake: {} ({alert:?})",
            match alert {
                AlertDescription::UnknownCA => "it does not trust the CA of our certificate",
                AlertDescription::BadCertificate => "it rejected our certificate",
                AlertDescription::CertificateExpired => "our certificate has expired",
                AlertDescription::CertificateRequired => "it requires a client certificate",
                AlertDescription::AccessDenied => "access denied",
                AlertDescription::HandshakeFailure => "no common parameters",
                _ => "alert",
            }
        ),
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the peer does not speak TLS (plaintext?)".into()
        }
        other => other.to_string(),
    }
}

/// [`describe`] for the I/O errors tokio-rustls returns (a rustls error inside, or a socket
/// error).
pub fn describe_io(err: &io::Error) -> String {
    match err
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        Some(tls) => describe(tls),
        None if err.kind() == io::ErrorKind::UnexpectedEof => {
            "the peer closed the connection during the handshake".into()
        }
        None => err.to_string(),
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The files of one side, parsed.
struct Loaded {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: RootCertStore,
}

fn load_files(files: &TlsFiles) -> Result<Loaded, TlsError> {
    let chain = read_certs(&files.cert)?;
    let key_pem = read(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|err| TlsError::File {
        path: files.key.clone(),
        reason: format!("no private key (PKCS#8, PKCS#1 or SEC1 PEM): {err}"),
    })?;
    let mut roots = RootCertStore::empty();
    for cert in read_certs(&files.ca)? {
        roots.add(cert).map_err(|err| TlsError::File {
            path: files.ca.clone(),
            reason: format!("not a usable CA certificate: {}", describe(&err)),
        })?;
    }
    Ok(Loaded { chain, key, roots })
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| TlsError::File {
            path: path.to_owned(),
            reason: format!("bad PEM: {err}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::File {
            path: path.to_owned(),
            reason: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

/// What the files looked like when last loaded: changes to any of these mean "re-read".
/// ctime changes on every write and rename and cannot be set back, so a replacement made
/// within the same mtime tick is still seen.
type Stamp = Vec<Option<FileStamp>>;

/// Device, inode, size, mtime (s, ns), ctime (s, ns) of one file.
type FileStamp = (u64, u64, u64, i64, i64, i64, i64);

fn stamp(files: &TlsFiles) -> Stamp {
    use std::os::unix::fs::MetadataExt as _;
    files
        .paths()
        .iter()
        .map(|path| {
            std::fs::metadata(path).ok().map(|m| {
                (
                    m.dev(),
                    m.ino(),
                    m.size(),
                    m.mtime(),
                    m.mtime_nsec(),
                    m.ctime(),
                    m.ctime_nsec(),
                )
            })
        })
        .collect()
}

/// A configuration built from files, rebuilt when they change.
struct Reloading<T> {
    files: TlsFiles,
    build: Box<dyn Fn(Loaded) -> Result<T, TlsError> + Send + Sync>,
    current: Mutex<Current<T>>,
}

struct Current<T> {
    /// The files as they were when `value` was built.
    stamp: Stamp,
    /// The configuration in use; `None` only while the files have never loaded (lazy).
    value: Option<Arc<T>>,
    /// Files that failed to load, and why: the error is logged once per change.
    failed: Option<(Stamp, String)>,
}

impl<T> Reloading<T> {
    /// Loads the files now; with `lazy`, files that do not load yet are not an error: every
    /// connection fails with the reason until they do.
    fn new(
        files: TlsFiles,
        build: impl Fn(Loaded) -> Result<T, TlsError> + Send + Sync + 'static,
        lazy: bool,
    ) -> Result<Reloading<T>, TlsError> {
        let stamp = stamp(&files);
        let built = load_files(&files).and_then(|loaded| {
            log_loaded(&files, &loaded, "TLS certificate loaded");
            build(loaded)
        });
        let (value, failed) = match built {
            Ok(value) => (Some(Arc::new(value)), None),
            Err(err) if lazy => {
                tracing::error!(error = %err, "TLS files do not load (yet); connections fail until they do");
                (None, Some((stamp.clone(), err.to_string())))
            }
            Err(err) => return Err(err),
        };
        Ok(Reloading {
            files,
            build: Box::new(build),
            current: Mutex::new(Current {
                stamp,
                value,
                failed,
            }),
        })
    }

    /// The configuration for a new connection: re-read first when a file changed.
    fn get(&self) -> Result<Arc<T>, TlsError> {
        let now = stamp(&self.files);
        // Every critical section leaves `Current` consistent; a poisoned lock is still usable.
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let unchanged = match (&current.value, &current.failed) {
            (_, Some((failed, _))) if *failed == now => true,
            (Some(_), _) => now == current.stamp,
            (None, _) => false,
        };
        if !unchanged {
            match load_files(&self.files).and_then(|loaded| {
                log_loaded(
                    &self.files,
                    &loaded,
                    "TLS files changed; new certificate loaded",
                );
                (self.build)(loaded)
            }) {
                Ok(value) => {
                    current.value = Some(Arc::new(value));
                    current.stamp = now;
                    current.failed = None;
                }
                Err(err) => {
                    tracing::error!(error = %err, "TLS files changed but do not load; keeping the previous certificate");
                    current.failed = Some((now, err.to_string()));
                }
            }
        }
        match (&current.value, &current.failed) {
            (Some(value), _) => Ok(value.clone()),
            (None, Some((_, why))) => Err(TlsError::Config(why.clone())),
            (None, None) => Err(TlsError::Config("TLS files not loaded".into())),
        }
    }
}

fn log_loaded(files: &TlsFiles, loaded: &Loaded, message: &str) {
    if let Some(leaf) = loaded.chain.first() {
        let peer = PeerCert::of(leaf);
        tracing::info!(
            cert = %files.cert.display(),
            sha256 = %peer.sha256,
            expires = %peer.not_after.map(humanize).unwrap_or_default(),
            names = ?peer.names,
            "{message}"
        );
    }
}

/// A time as RFC 3339 UTC (seconds), for logs.
pub fn humanize(time: SystemTime) -> String {
    let secs = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The server side: an acceptor that requires client certificates.
pub struct ServerTls {
    config: Reloading<rustls::ServerConfig>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.config.files)
            .finish()
    }
}

impl ServerTls {
    /// Loads the files (an error names the one that does not load); `require`: the identity
    /// every client certificate must carry, besides being signed by `files.ca`.
    pub fn load(files: TlsFiles, require: Option<Identity>) -> Result<ServerTls, TlsError> {
        let config = Reloading::new(
            files,
            move |loaded| server_config(loaded, &Clients::Certified(require.clone())),
            false,
        )?;
        Ok(ServerTls { config })
    }

    /// The handshake, with the files of this moment; a refused client is an error (the
    /// connection is closed, after an alert).
    pub async fn accept(
        &self,
        tcp: TcpStream,
    ) -> Result<tokio_rustls::server::TlsStream<TcpStream>, TlsError> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.get()?);
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(err)) => Err(TlsError::Handshake(describe_io(&err))),
            Err(_) => Err(TlsError::Handshake(format!(
                "no handshake within {HANDSHAKE_TIMEOUT:?}"
            ))),
        }
    }
}

impl ServerTls {
    /// A reloading acceptor for browsers (the entrypoint): server authentication only, no
    /// client certificate asked, ALPN `http/1.1`. The certificate stands in for the CA file the
    /// reloading machinery watches; it is not used to verify anything.
    pub fn load_web(cert: PathBuf, key: PathBuf) -> Result<ServerTls, TlsError> {
        let files = TlsFiles {
            ca: cert.clone(),
            cert,
            key,
        };
        let config = Reloading::new(
            files,
            |loaded| server_config(loaded, &Clients::Anyone),
            false,
        )?;
        Ok(ServerTls { config })
    }
}

/// Who a server lets in.
#[derive(Debug, Clone)]
enum Clients {
    /// Browsers (the entrypoint): no client certificate asked, ALPN `http/1.1`.
    Anyone,
    /// Peers with a certificate chained to the CA file, carrying the identity when one is
    /// given (the agent protocol: ALPN `h2`).
    Certified(Option<Identity>),
}

/// The server configuration of `loaded`, letting in `clients`.
fn server_config(loaded: Loaded, clients: &Clients) -> Result<rustls::ServerConfig, TlsError> {
    let provider = provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsError::Config(err.to_string()))?;
    let (builder, alpn) = match clients {
        Clients::Anyone => (builder.with_no_client_auth(), b"http/1.1".as_slice()),
        Clients::Certified(require) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(loaded.roots), provider)
                    .build()
                    .map_err(|err| TlsError::Config(format!("client CA: {err}")))?;
            let verifier: Arc<dyn ClientCertVerifier> = match require {
                Some(want) => Arc::new(RequireIdentity {
                    inner: verifier,
                    want: want.clone(),
                }),
                None => verifier,
            };
            (
                builder.with_client_cert_verifier(verifier),
                b"h2".as_slice(),
            )
        }
    };
    let mut config = builder
        .with_single_cert(loaded.chain, loaded.key)
        .map_err(mismatched)?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(config)
}

/// A certificate whose key is not the one given.
fn mismatched(err: rustls::Error) -> TlsError {
    TlsError::Config(format!(
        "certificate and key do not go together: {}",
        describe(&err)
    ))
}

/// The web PKI client verifier, then the required identity.
#[derive(Debug)]
struct RequireIdentity {
    inner: Arc<dyn ClientCertVerifier>,
    want: Identity,
}

impl ClientCertVerifier for RequireIdentity {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        check_identity(end_entity, &self.want)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// What the last connection of a [`ClientTls`] showed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientStatus {
    /// The server's certificate on the last connection it accepted (it sent data: in TLS 1.3 a
    /// server judges our certificate after the handshake, so the handshake alone proves
    /// nothing).
    pub peer: Option<PeerCert>,
    /// Why the last connection attempt failed (TCP, or `TLS: …` for the handshake or the
    /// server's refusal of our certificate); cleared by a connection that works.
    pub failure: Option<String>,
}

/// The client side: a connector that presents our certificate and verifies the server's.
pub struct ClientTls {
    config: Reloading<rustls::ClientConfig>,
    status: Mutex<ClientStatus>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("files", &self.config.files)
            .finish()
    }
}

impl ClientTls {
    /// Loads the files (an error names the one that does not load); `server_name`: the
    /// identity the server's certificate must carry.
    pub fn load(files: TlsFiles, server_name: Identity) -> Result<ClientTls, TlsError> {
        Self::build(files, server_name, false)
    }

    /// [`ClientTls::load`] for files that may not be there yet (a Secret not yet issued):
    /// until they load, every connection fails with the reason (in [`ClientTls::status`]).
    pub fn load_lazy(files: TlsFiles, server_name: Identity) -> ClientTls {
        match Self::build(files, server_name, true) {
            Ok(tls) => tls,
            // `lazy` turns every load error into a connection-time error.
            Err(_) => unreachable!("a lazy load does not fail"),
        }
    }

    fn build(files: TlsFiles, server_name: Identity, lazy: bool) -> Result<ClientTls, TlsError> {
        let config = Reloading::new(
            files,
            move |loaded| client_config(loaded, server_name.clone()),
            lazy,
        )?;
        Ok(ClientTls {
            config,
            status: Mutex::new(ClientStatus::default()),
        })
    }

    /// The last connection's peer certificate, or why it failed.
    pub fn status(&self) -> ClientStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn update(&self, change: impl FnOnce(&mut ClientStatus)) {
        change(&mut self.status.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// One handshake over `tcp` with the files of this moment. `host` is sent as SNI (when a
    /// DNS name); the server's certificate is checked against the configured identity.
    pub async fn connect(
        &self,
        tcp: TcpStream,
        host: &str,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, TlsError> {
        let name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
            .map_err(|_| TlsError::Handshake(format!("`{host}` is not a DNS name or address")))?
            .to_owned();
        let connector = tokio_rustls::TlsConnector::from(self.config.get()?);
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp)).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(err)) => Err(TlsError::Handshake(describe_io(&err))),
            Err(_) => Err(TlsError::Handshake(format!(
                "no handshake within {HANDSHAKE_TIMEOUT:?}"
            ))),
        }
    }

    /// TCP to the URI's host and port, then [`ClientTls::connect`], then the server's first
    /// bytes (an HTTP/2 server speaks first, its SETTINGS): in TLS 1.3 a server judges our
    /// certificate only after the handshake completed on our side, so its verdict is what it
    /// sends next: data (kept for the first read) or an alert. Waiting for it before we write
    /// anything keeps the alert from being lost to a reset. A server silent for
    /// [`FIRST_BYTES`] is not held up: its verdict is then taken from the first read.
    /// The outcome is recorded in [`ClientTls::status`].
    pub async fn dial(
        self: &Arc<Self>,
        uri: &http::Uri,
    ) -> Result<Proving<tokio_rustls::client::TlsStream<TcpStream>>, TlsError> {
        let result = async {
            let host = uri
                .host()
                .ok_or_else(|| TlsError::Handshake(format!("`{uri}` has no host")))?;
            let port = uri.port_u16().unwrap_or(443);
            let tcp =
                TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port))
                    .await
                    .map_err(|err| {
                        TlsError::Connect(format!("cannot connect to {host}:{port}: {err}"))
                    })?;
            // gRPC's small messages must leave at once.
            let _ = tcp.set_nodelay(true);
            let mut stream = self.connect(tcp, host).await?;
            let mut first = vec![0; 4096];
            let read = tokio::time::timeout(FIRST_BYTES, {
                use tokio::io::AsyncReadExt as _;
                stream.read(&mut first)
            })
            .await;
            let first = match read {
                Ok(Ok(0)) => {
                    return Err(TlsError::Handshake(
                        "the peer closed the connection at once (did it refuse our certificate?)"
                            .into(),
                    ));
                }
                Ok(Ok(n)) => {
                    first.truncate(n);
                    Some(first)
                }
                Ok(Err(err)) => return Err(TlsError::Handshake(describe_io(&err))),
                Err(_) => None,
            };
            Ok((stream, first))
        }
        .await;
        match result {
            Ok((stream, first)) => {
                let peer = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(PeerCert::of);
                let mut proving = Proving {
                    inner: stream,
                    tls: self.clone(),
                    peer,
                    proven: false,
                    first: Vec::new(),
                };
                if let Some(first) = first {
                    proving.prove();
                    proving.first = first;
                }
                Ok(proving)
            }
            Err(err) => {
                let reason = err.to_string();
                self.update(|s| s.failure = Some(reason));
                Err(err)
            }
        }
    }

    /// A lazy channel to `endpoint` (its URI gives host and port; `https://`) whose every
    /// connection is a new TCP connection and handshake with the files of that moment.
    ///
    /// Tonic is built without its own TLS: with it, an `https://` endpoint would be refused
    /// for want of tonic's TLS config even though this connector does the handshake.
    pub fn channel(
        self: &Arc<Self>,
        endpoint: tonic::transport::Endpoint,
    ) -> tonic::transport::Channel {
        let tls = self.clone();
        endpoint.connect_with_connector_lazy(tower::service_fn(move |uri: http::Uri| {
            let tls = tls.clone();
            async move { tls.dial(&uri).await.map(hyper_util::rt::TokioIo::new) }
        }))
    }
}

fn client_config(loaded: Loaded, want: Identity) -> Result<rustls::ClientConfig, TlsError> {
    let provider = provider();
    let verifier = Arc::new(ServerVerifier {
        roots: Arc::new(loaded.roots),
        want,
        provider: provider.clone(),
    });
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsError::Config(err.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(loaded.chain, loaded.key)
        .map_err(mismatched)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The web PKI chain check, then the configured identity (DNS or `spiffe://` URI) instead of
/// the name dialled: SPIFFE certificates carry no DNS name.
#[derive(Debug)]
struct ServerVerifier {
    roots: Arc<RootCertStore>,
    want: Identity,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        check_identity(end_entity, &self.want)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client connection not yet proven accepted: the first bytes from the server record its
/// certificate in [`ClientTls::status`]; an error before them (the server's alert refusing our
/// certificate) records the failure.
pub struct Proving<S> {
    inner: S,
    tls: Arc<ClientTls>,
    peer: Option<PeerCert>,
    proven: bool,
    /// The server's first bytes, read by [`ClientTls::dial`], handed out before any other.
    first: Vec<u8>,
}

impl<S> Proving<S> {
    /// The server accepted us: its certificate becomes the one operators see.
    fn prove(&mut self) {
        self.proven = true;
        let peer = self.peer.take();
        self.tls.update(|s| {
            s.peer = peer;
            s.failure = None;
        });
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Proving<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.first.is_empty() {
            let n = this.first.len().min(buf.remaining());
            buf.put_slice(&this.first[..n]);
            this.first.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        if !this.proven {
            match &result {
                Poll::Ready(Ok(())) if buf.filled().len() > before => this.prove(),
                Poll::Ready(Ok(())) => {
                    this.proven = true;
                    this.tls.update(|s| {
                        s.failure = Some("TLS: the peer closed the connection at once".into())
                    });
                }
                Poll::Ready(Err(err)) => {
                    this.proven = true;
                    let reason = format!("TLS: {}", describe_io(err));
                    this.tls.update(|s| s.failure = Some(reason));
                }
                Poll::Pending => {}
            }
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Proving<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// An agent's transport flags, for `#[command(flatten)]` into its settings.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// This agent's certificate chain (PEM, leaf first). With --tls-key and --tls-client-ca the
    /// agent serves mTLS only; the files are re-read when they change.
    #[arg(long = "tls-cert", env = "ANTIDOTE_AGENT_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// This agent's private key (PEM).
    #[arg(long = "tls-key", env = "ANTIDOTE_AGENT_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) that sign the scheduler's client certificate; every other
    /// caller is refused in the handshake.
    #[arg(
        long = "tls-client-ca",
        env = "ANTIDOTE_AGENT_TLS_CLIENT_CA",
        value_name = "PEM"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// The identity the client certificate must carry too: a DNS name or a spiffe:// URI.
    #[arg(
        long = "tls-require-identity",
        env = "ANTIDOTE_AGENT_TLS_REQUIRE_IDENTITY",
        value_name = "NAME"
    )]
    pub tls_require_identity: Option<String>,
    /// Serve plaintext on an address other than loopback: only where a service mesh's
    /// sidecars do mTLS for this agent ("mesh mode"). Anyone reaching the port could drive
    /// the agent otherwise.
    #[arg(long = "insecure-plaintext", env = "ANTIDOTE_AGENT_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
}

impl TlsArgs {
    /// The server TLS these flags ask for; `None` for plaintext. Half the TLS flags, or
    /// `--tls-require-identity` without them, is an error naming what is missing.
    pub fn server_tls(&self) -> Result<Option<ServerTls>, TlsError> {
        match (&self.tls_cert, &self.tls_key, &self.tls_client_ca) {
            (None, None, None) => {
                if self.tls_require_identity.is_some() {
                    return Err(TlsError::Flags(
                        "--tls-require-identity needs --tls-cert, --tls-key and --tls-client-ca"
                            .into(),
                    ));
                }
                Ok(None)
            }
            (Some(cert), Some(key), Some(ca)) => {
                if self.insecure_plaintext {
                    return Err(TlsError::Flags(
                        "--insecure-plaintext contradicts --tls-cert/--tls-key/--tls-client-ca"
                            .into(),
                    ));
                }
                let require = self
                    .tls_require_identity
                    .as_deref()
                    .map(Identity::parse)
                    .transpose()?;
                let files = TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    ca: ca.clone(),
                };
                ServerTls::load(files, require).map(Some)
            }
            (cert, key, ca) => {
                let missing: Vec<&str> = [
                    (cert.is_none(), "--tls-cert"),
                    (key.is_none(), "--tls-key"),
                    (ca.is_none(), "--tls-client-ca"),
                ]
                .into_iter()
                .filter_map(|(missing, flag)| missing.then_some(flag))
                .collect();
                Err(TlsError::Flags(format!(
                    "mTLS needs --tls-cert, --tls-key and --tls-client-ca; missing {}",
                    missing.join(", ")
                )))
            }
        }
    }

    /// The bound socket as the SDK serves it: TLS when configured; plaintext on loopback; on
    /// any other address plaintext only with `--insecure-plaintext`, and a loud warning.
    pub fn listener(&self, tcp: TcpListener) -> Result<super::Listener, TlsError> {
        let local = tcp
            .local_addr()
            .map_err(|err| TlsError::Flags(format!("listener has no address: {err}")))?;
        match self.server_tls()? {
            Some(tls) => {
                tracing::info!(listen = %local, "serving mTLS only");
                Ok(super::Listener::tls(tcp, tls))
            }
            None => {
                plaintext_allowed(local, self.insecure_plaintext)?;
                Ok(super::Listener::plain(tcp))
            }
        }
    }
}

/// Plaintext on loopback is fine; elsewhere it must be the operator's explicit choice.
fn plaintext_allowed(local: SocketAddr, insecure: bool) -> Result<(), TlsError> {
    if local.ip().is_loopback() {
        return Ok(());
    }
    if insecure {
        tracing::warn!(
            listen = %local,
            "SERVING PLAINTEXT WITHOUT AUTHENTICATION on a non-loopback address \
             (--insecure-plaintext): anyone who reaches this port controls the agent unless a \
             service mesh does mTLS and authorizes only the scheduler"
        );
        return Ok(());
    }
    Err(TlsError::Flags(format!(
        "refusing to serve plaintext on {local}: give --tls-cert, --tls-key and \
         --tls-client-ca (ANTIDOTE_AGENT_TLS_*), listen on loopback, or pass \
         --insecure-plaintext where a service mesh does mTLS for this agent"
    )))
}

fn names(cert: &CertificateDer<'_>) -> Vec<String> {
    match webpki::EndEntityCert::try_from(cert) {
        Ok(cert) => cert
            .valid_dns_names()
            .map(|name| format!("DNS:{name}"))
            .chain(cert.valid_uri_names().map(|uri| format!("URI:{uri}")))
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One DER element: tag, contents, what follows. `None` when malformed.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// A certificate's notAfter: Certificate → tbsCertificate → [version], serial, signature,
/// issuer, validity → notAfter (UTCTime or GeneralizedTime, RFC 5280 §4.1.2.5).
fn not_after(der: &[u8]) -> Option<SystemTime> {
    const SEQUENCE: u8 = 0x30;
    let (SEQUENCE, certificate, _) = der_element(der)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der_element(certificate)? else {
        return None;
    };
    let (tag, _, mut rest) = der_element(tbs)?;
    if tag == 0xa0 {
        // An explicit version comes first; the serial follows.
        rest = der_element(rest)?.2;
    }
    let (_, _, rest) = der_element(rest)?; // signature algorithm
    let (_, _, rest) = der_element(rest)?; // issuer
    let (SEQUENCE, validity, _) = der_element(rest)? else {
        return None;
    };
    let (_, _, validity) = der_element(validity)?; // notBefore
    let (tag, time, _) = der_element(validity)?;
    let text = std::str::from_utf8(time).ok()?.strip_suffix('Z')?;
    let (year, rest) = match tag {
        0x17 => {
            let yy: i64 = text.get(..2)?.parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, text.get(2..)?)
        }
        0x18 => (text.get(..4)?.parse().ok()?, text.get(4..)?),
        _ => return None,
    };
    if rest.len() != 10 || !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let field = |i: usize| rest[i..i + 2].parse::<i64>().ok();
    let (month, day, hour, minute, second) =
        (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second;
    Some(if secs >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs as u64)
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, SanType};

    fn cert(sans: Vec<SanType>, not_after: (i32, u8, u8)) -> CertificateDer<'static> {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "test CA");
        let issuer = Issuer::new(ca, ca_key);
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        let key = KeyPair::generate().unwrap();
        params.signed_by(&key, &issuer).unwrap().der().clone()
    }

    fn dns(name: &str) -> SanType {
        SanType::DnsName(name.try_into().unwrap())
    }

    fn uri(text: &str) -> SanType {
        SanType::URI(text.try_into().unwrap())
    }

    /// `check(sans, identity, ok)`: the one table of the SAN check.
    fn check(sans: Vec<SanType>, identity: &str, ok: bool) {
        let cert = cert(sans, (2040, 1, 1));
        let want = Identity::parse(identity).unwrap();
        let result = check_identity(&cert, &want);
        assert_eq!(result.is_ok(), ok, "{identity}: {result:?}");
        if let Err(err) = result {
            let text = describe(&err);
            assert!(text.contains(&want.to_string()), "{text}");
        }
    }

    #[test]
    fn san_check() {
        check(vec![dns("scheduler.example")], "scheduler.example", true);
        check(vec![dns("scheduler.example")], "SCHEDULER.example", true);
        check(vec![dns("scheduler.example")], "other.example", false);
        check(vec![dns("*.antidote.svc")], "scheduler.antidote.svc", true);
        check(vec![dns("*.antidote.svc")], "a.b.antidote.svc", false);
        let spiffe = "spiffe://example.org/ns/antidote/sa/scheduler";
        check(vec![uri(spiffe)], spiffe, true);
        check(
            vec![uri(spiffe)],
            "spiffe://example.org/ns/antidote/sa/agent",
            false,
        );
        // A URI SAN never satisfies a DNS identity, nor the reverse.
        check(
            vec![uri("spiffe://scheduler.example")],
            "scheduler.example",
            false,
        );
        check(vec![dns("example.org")], "spiffe://example.org", false);
        check(vec![dns("a.example"), uri(spiffe)], spiffe, true);
        check(vec![], "a.example", false);
    }

    #[test]
    fn identities_parse() {
        assert_eq!(
            Identity::parse("spiffe://td/x").unwrap(),
            Identity::Uri("spiffe://td/x".into())
        );
        assert_eq!(
            Identity::parse("agent.example").unwrap(),
            Identity::Dns("agent.example".into())
        );
        assert!(Identity::parse("https://x").is_err());
        assert!(Identity::parse("spiffe://").is_err());
        assert!(Identity::parse("not a name").is_err());
    }

    #[test]
    fn peer_cert_reads_expiry_names_and_identity() {
        let spiffe = "spiffe://example.org/agent/a";
        let der = cert(vec![dns("agent.example"), uri(spiffe)], (2031, 7, 9));
        let peer = PeerCert::of(&der);
        assert_eq!(
            peer.not_after.map(humanize).as_deref(),
            Some("2031-07-09T00:00:00Z")
        );
        assert_eq!(peer.sha256.len(), 64);
        assert_eq!(
            peer.names,
            vec!["DNS:agent.example".to_owned(), format!("URI:{spiffe}")]
        );
        assert_eq!(peer_identity(&der).as_deref(), Some(spiffe));
        let der = cert(vec![dns("agent.example")], (2051, 2, 28));
        assert_eq!(peer_identity(&der).as_deref(), Some("agent.example"));
        // 2051 needs GeneralizedTime.
        assert_eq!(
            PeerCert::of(&der).not_after.map(humanize).as_deref(),
            Some("2051-02-28T00:00:00Z")
        );
    }

    #[test]
    fn plaintext_policy() {
        let loopback: SocketAddr = "127.0.0.1:7071".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:7071".parse().unwrap();
        assert!(plaintext_allowed(loopback, false).is_ok());
        assert!(plaintext_allowed("[::1]:1".parse().unwrap(), false).is_ok());
        let refused = plaintext_allowed(any, false).unwrap_err().to_string();
        assert!(refused.contains("--insecure-plaintext"), "{refused}");
        assert!(plaintext_allowed(any, true).is_ok());
        let half = TlsArgs {
            tls_cert: Some("c.pem".into()),
            ..TlsArgs::default()
        };
        let err = half.server_tls().unwrap_err().to_string();
        assert!(err.contains("missing --tls-key, --tls-client-ca"), "{err}");
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let files = TlsFiles {
            cert: empty.clone(),
            key: dir.path().join("missing.pem"),
            ca: empty.clone(),
        };
        let err = ServerTls::load(files, None).unwrap_err().to_string();
        assert!(err.contains("empty.pem: no CERTIFICATE block"), "{err}");
    }
}
