//! Who may call. Learners hold a session token: a secret answered once by
//! CreateSession, kept only as its SHA-256, sent as `authorization: Bearer TOKEN` (or the
//! `antidote_session` cookie on the JSON API). Operators call the admin API, on its own
//! listener, with static bearer tokens configured by their SHA-256 and scopes, or with OIDC JWTs
//! from their single sign-on, verified against a JWKS file (`admin.oidc`).
//!
//! Tokens are 256 random bits from the OS, so a single SHA-256 suffices to store them (there is
//! nothing to brute-force, unlike a password): no slow hash on every call.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tonic::metadata::MetadataMap;

use crate::error::Error;
use crate::settings::{AdminConfig, OidcConfig, Scope};

/// The prefix of learners' session tokens, so a leaked one is recognisable in logs and scanners.
const SESSION_TOKEN_PREFIX: &str = "ast_";

/// The cookie the JSON API sets at CreateSession and reads when no `authorization` header
/// comes (browsers' EventSource cannot send headers).
pub const SESSION_COOKIE: &str = "antidote_session";

/// How often the JWKS file's modification time is looked at, so that a rotated key set is
/// picked up without a restart (and without a file system call on every admin call).
const JWKS_RECHECK: Duration = Duration::from_secs(5);

/// How often a token naming a key we do not know may make us read the JWKS file again: a new
/// key is usually announced just before tokens signed by it arrive, but made-up `kid`s must not
/// turn every call into a file read.
const JWKS_UNKNOWN_KID_RELOAD: Duration = Duration::from_secs(1);

/// The clock skew between the identity provider and us tolerated on `exp` and `nbf`.
const JWT_LEEWAY: Duration = Duration::from_secs(30);

/// The longest identity or key id we repeat (in the audit log, in refusals); claims come from
/// the identity provider, key ids from anyone.
const MAX_SHOWN: usize = 128;

/// A new session token (shown to the learner once) and the hash the store keeps.
pub fn new_session_token() -> Result<(String, [u8; 32]), Error> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret)
        .map_err(|err| Error::Commit(format!("the OS gave no random bytes: {err}")))?;
    let token = format!("{SESSION_TOKEN_PREFIX}{}", hex::encode(secret));
    let hash = hash(&token);
    Ok((token, hash))
}

/// The SHA-256 of a token, as stored and configured.
pub fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The bearer token of a call, if it carries one.
pub fn bearer(metadata: &MetadataMap) -> Option<&str> {
    let value = metadata.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The admin API's credentials: static tokens by their hashes, with a name (the identity
/// audited) and scopes; and, if configured, the OIDC provider whose JWTs are accepted.
#[derive(Debug, Default)]
pub struct AdminAuth {
    /// Static tokens: hash → (name, scopes).
    tokens: HashMap<[u8; 32], (String, Vec<Scope>)>,
    /// The operators' single sign-on, if `admin.oidc` is set.
    oidc: Option<Oidc>,
    /// Unauthenticated refusals audited per client network and minute.
    pub refusals: super::limits::Refusals,
}

impl AdminAuth {
    /// The configured tokens (validated by the settings: 64 hex digits each) and OIDC provider
    /// (its JWKS file read now; a key it cannot use is logged and left out).
    pub fn new(config: &AdminConfig) -> AdminAuth {
        let tokens = config
            .tokens
            .iter()
            .filter_map(|t| {
                let mut hash = [0u8; 32];
                hex::decode_to_slice(&t.sha256, &mut hash).ok()?;
                Some((hash, (t.name.clone(), t.scopes.clone())))
            })
            .collect();
        let oidc = config
            .oidc
            .as_ref()
            .map(|oidc| Oidc::new(oidc.clone(), Instant::now()));
        AdminAuth {
            tokens,
            oidc,
            refusals: Default::default(),
        }
    }

    /// Who the caller is, if its token allows `scope`: UNAUTHENTICATED without a known token
    /// (the message says which check failed), PERMISSION_DENIED without the scope. The identity
    /// is `token:NAME` for a static token, `oidc:SUBJECT` for a JWT.
    ///
    /// A static token is looked up first (one hash); only a value shaped like a JWT goes on to
    /// OIDC, when it is configured.
    pub fn check(&self, metadata: &MetadataMap, scope: Scope) -> Result<String, (String, Error)> {
        self.check_at(metadata, scope, Instant::now())
    }

    /// [`AdminAuth::check`] at `now` (which decides when the JWKS file is looked at again).
    fn check_at(
        &self,
        metadata: &MetadataMap,
        scope: Scope,
        now: Instant,
    ) -> Result<String, (String, Error)> {
        let unauthenticated =
            |reason: String| Err(("anonymous".to_owned(), Error::Unauthenticated(reason)));
        let Some(token) = bearer(metadata) else {
            return unauthenticated("the admin API needs `authorization: Bearer TOKEN`".into());
        };
        let (identity, scopes) = if let Some((name, scopes)) = self.tokens.get(&hash(token)) {
            (format!("token:{name}"), scopes.clone())
        } else if let Some(oidc) = &self.oidc
            && looks_like_jwt(token)
        {
            match oidc.verify(token, now) {
                Ok((subject, scopes)) => (format!("oidc:{subject}"), scopes),
                Err(reason) => return unauthenticated(reason),
            }
        } else {
            return unauthenticated("the bearer token is not one this scheduler knows".into());
        };
        // Write implies read: an operator who may kill may also look.
        if scopes.contains(&scope) || scopes.contains(&Scope::Write) {
            return Ok(identity);
        }
        Err((
            identity.clone(),
            Error::PermissionDenied {
                identity,
                scope: scope.as_str(),
            },
        ))
    }
}

/// Whether a bearer token has a JWT's shape: three dot-separated base64url parts (the last may
/// be empty, as in an unsigned `alg: none` token, so that it is refused by OIDC with its reason).
fn looks_like_jwt(token: &str) -> bool {
    let mut parts = token.split('.');
    let (Some(header), Some(claims), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    !header.is_empty()
        && !claims.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// At most [`MAX_SHOWN`] printable characters of a value a caller or provider chose.
fn shown(value: &str) -> String {
    value
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_SHOWN)
        .collect()
}

/// The operators' OIDC provider: its settings and the keys of its JWKS file.
struct Oidc {
    /// Issuer, audience, claims and the JWKS file.
    config: OidcConfig,
    /// The keys, refreshed from the file when it changes. A std mutex: held only to look at the
    /// file (rarely, rate-limited) and to clone an `Arc`, never across an await.
    jwks: Mutex<Jwks>,
}

impl std::fmt::Debug for Oidc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oidc")
            .field("issuer", &self.config.issuer)
            .field("audience", &self.config.audience)
            .field("jwks_file", &self.config.jwks_file)
            .finish_non_exhaustive()
    }
}

/// The key set last read from the JWKS file, and when the file was looked at.
struct Jwks {
    /// Verifying keys by `kid`.
    keys: HashMap<String, Arc<VerifyingKey>>,
    /// The file's modification time and length when it was last read (`None`: never read), so
    /// an unchanged file is not read again.
    version: Option<(SystemTime, u64)>,
    /// When the file's metadata was last looked at.
    checked: Instant,
    /// When a token with an unknown `kid` last made us look at the file.
    unknown_kid_reload: Option<Instant>,
}

/// One key of the JWKS with the validation its tokens pass: only the algorithms its type (and
/// its `alg`, if it names one) allows, so a public key is never used as an HMAC secret.
struct VerifyingKey {
    /// The public key.
    key: DecodingKey,
    /// Algorithms, issuer, audience, `exp`/`nbf` with leeway.
    validation: Validation,
}

impl Oidc {
    fn new(config: OidcConfig, now: Instant) -> Oidc {
        let mut jwks = Jwks {
            keys: HashMap::new(),
            version: None,
            checked: now,
            unknown_kid_reload: None,
        };
        jwks.refresh(&config, now, true);
        Oidc {
            config,
            jwks: Mutex::new(jwks),
        }
    }

    /// The caller's identity and admin scopes, if `token` is a JWT of our provider's that is
    /// valid now; otherwise which check failed (never the token).
    fn verify(&self, token: &str, now: Instant) -> Result<(String, Vec<Scope>), String> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| {
            "the JWT's header is unreadable or names an algorithm never accepted (`none`)"
                .to_owned()
        })?;
        let Some(kid) = header.kid.as_deref() else {
            return Err("the JWT names no signing key (`kid`)".into());
        };
        let key = self.key(kid, now);
        let kid = shown(kid);
        let key = key.ok_or_else(|| format!("the JWT's signing key `{kid}` is not in the JWKS"))?;
        let data = jsonwebtoken::decode::<serde_json::Map<String, Value>>(
            token,
            &key.key,
            &key.validation,
        )
        .map_err(|err| self.explain(err.kind(), header.alg, &kid))?;
        let claims = data.claims;
        let identity_claim = &self.config.identity_claim;
        let subject = match claims.get(identity_claim) {
            Some(Value::String(subject)) if !subject.is_empty() => shown(subject),
            _ => {
                return Err(format!(
                    "the JWT has no `{identity_claim}` claim naming the caller"
                ));
            }
        };
        // OAuth's `scope` is one space-separated string; some providers send an array.
        let granted: Vec<&str> = match claims.get(&self.config.scope_claim) {
            Some(Value::String(scopes)) => scopes.split_whitespace().collect(),
            Some(Value::Array(scopes)) => scopes.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let scopes = [Scope::Read, Scope::Write]
            .into_iter()
            .filter(|scope| granted.contains(&scope.as_str()))
            .collect();
        Ok((subject, scopes))
    }

    /// Why `decode` refused a token, in words, naming the check.
    fn explain(&self, kind: &ErrorKind, alg: Algorithm, kid: &str) -> String {
        match kind {
            ErrorKind::ExpiredSignature => "the JWT has expired (`exp`)".into(),
            ErrorKind::ImmatureSignature => "the JWT is not valid yet (`nbf`)".into(),
            ErrorKind::InvalidIssuer => {
                format!("the JWT's issuer (`iss`) is not `{}`", self.config.issuer)
            }
            ErrorKind::InvalidAudience => {
                format!(
                    "the JWT's audience (`aud`) is not `{}`",
                    self.config.audience
                )
            }
            ErrorKind::InvalidSignature => {
                format!("the JWT's signature does not verify with key `{kid}`")
            }
            ErrorKind::InvalidAlgorithm => {
                format!("the JWT's algorithm {alg:?} is not one key `{kid}` is for")
            }
            ErrorKind::MissingRequiredClaim(claim) => format!("the JWT has no `{claim}` claim"),
            ErrorKind::InvalidClaimFormat(claim) => {
                format!("the JWT's `{claim}` claim is malformed")
            }
            _ => "the JWT is malformed".into(),
        }
    }

    /// The key named `kid`, looking at the JWKS file first if it is due: every
    /// [`JWKS_RECHECK`], or at most every [`JWKS_UNKNOWN_KID_RELOAD`] for a `kid` we do not
    /// know. The file is small and only its metadata is read unless it changed, so this blocking
    /// I/O is short enough to do inline.
    fn key(&self, kid: &str, now: Instant) -> Option<Arc<VerifyingKey>> {
        let mut jwks = self.jwks.lock().unwrap_or_else(PoisonError::into_inner);
        if now.saturating_duration_since(jwks.checked) >= JWKS_RECHECK {
            jwks.refresh(&self.config, now, false);
        }
        if !jwks.keys.contains_key(kid)
            && jwks
                .unknown_kid_reload
                .is_none_or(|last| now.saturating_duration_since(last) >= JWKS_UNKNOWN_KID_RELOAD)
        {
            jwks.unknown_kid_reload = Some(now);
            jwks.refresh(&self.config, now, true);
        }
        jwks.keys.get(kid).cloned()
    }
}

impl Jwks {
    /// Reads the JWKS file again if its modification time or length changed, or whatever they
    /// are when `force`d (a rewrite within one tick of the file system's clock keeps the time).
    /// A file that cannot be read or parsed (being rewritten, say) leaves the keys we have.
    fn refresh(&mut self, config: &OidcConfig, now: Instant, force: bool) {
        self.checked = now;
        let path = &config.jwks_file;
        let version = match std::fs::metadata(path) {
            Ok(meta) => meta.modified().ok().map(|modified| (modified, meta.len())),
            Err(err) => {
                tracing::warn!(error = %err, "cannot read admin.oidc.jwks_file; keeping the keys we have");
                return;
            }
        };
        if !force && version.is_some() && version == self.version {
            return;
        }
        match load_jwks(path, config) {
            Ok(keys) => {
                tracing::info!(count = keys.len(), "admin.oidc.jwks_file loaded");
                self.keys = keys;
                self.version = version;
            }
            Err(err) => {
                tracing::warn!(error = %err, "admin.oidc.jwks_file is not usable; keeping the keys we have");
            }
        }
    }
}

/// The usable keys of a JWKS file, by `kid`. Keys without a `kid`, for encryption, of a type we
/// cannot verify with, or shared secrets (HMAC keys have no place in a published key set) are
/// logged and left out.
fn load_jwks(
    path: &Path,
    config: &OidcConfig,
) -> Result<HashMap<String, Arc<VerifyingKey>>, String> {
    #[derive(serde::Deserialize)]
    struct JwksFile {
        keys: Vec<Value>,
    }
    let text = std::fs::read(path).map_err(|err| err.to_string())?;
    let file: JwksFile =
        serde_json::from_slice(&text).map_err(|err| format!("not a JWKS document: {err}"))?;
    let mut keys = HashMap::new();
    for (i, key) in file.keys.into_iter().enumerate() {
        match verifying_key(key, config) {
            Ok((kid, key)) => {
                keys.insert(kid, Arc::new(key));
            }
            Err(reason) => {
                tracing::warn!(reason = %format!("key {i}: {reason}"), "a key of admin.oidc.jwks_file is left out")
            }
        }
    }
    Ok(keys)
}

/// One JWKS entry as a key with its validation.
fn verifying_key(key: Value, config: &OidcConfig) -> Result<(String, VerifyingKey), String> {
    let jwk: Jwk = serde_json::from_value(key).map_err(|err| format!("not a JWK: {err}"))?;
    let kid = jwk.common.key_id.clone().ok_or("it has no `kid`")?;
    if matches!(jwk.common.public_key_use, Some(ref usage) if *usage != PublicKeyUse::Signature) {
        return Err(format!("key `{kid}` is not for signatures (`use`)"));
    }
    let family: &[Algorithm] = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => &[
            Algorithm::RS256,
            Algorithm::RS384,
            Algorithm::RS512,
            Algorithm::PS256,
            Algorithm::PS384,
            Algorithm::PS512,
        ],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => &[Algorithm::ES256],
            EllipticCurve::P384 => &[Algorithm::ES384],
            _ => return Err(format!("key `{kid}` is on a curve we cannot verify with")),
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => {
            &[Algorithm::EdDSA]
        }
        AlgorithmParameters::OctetKey(_) => {
            return Err(format!(
                "key `{kid}` is a shared secret (HMAC), never accepted from a JWKS"
            ));
        }
        _ => return Err(format!("key `{kid}` is of a type we cannot verify with")),
    };
    // A key that names its algorithm is used with that one only.
    let algorithms = match jwk.common.key_algorithm {
        None => family.to_vec(),
        Some(alg) => match Algorithm::try_from(alg) {
            Ok(alg) if family.contains(&alg) => vec![alg],
            _ => {
                return Err(format!(
                    "key `{kid}` names an algorithm ({alg}) its type does not have"
                ));
            }
        },
    };
    let decoding = DecodingKey::from_jwk(&jwk).map_err(|err| format!("key `{kid}`: {err}"))?;
    let mut validation = Validation::new(algorithms[0]);
    validation.algorithms = algorithms;
    validation.leeway = JWT_LEEWAY.as_secs();
    validation.validate_nbf = true;
    validation.set_issuer(&[&config.issuer]);
    validation.set_audience(&[&config.audience]);
    validation.set_required_spec_claims(&["exp", "iss", "aud"]);
    Ok((
        kid,
        VerifyingKey {
            key: decoding,
            validation,
        },
    ))
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{EncodingKey, Header};

    use super::*;
    use crate::settings::AdminToken;

    fn metadata(authorization: Option<&str>) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        if let Some(value) = authorization {
            metadata.insert("authorization", value.parse().unwrap());
        }
        metadata
    }

    #[test]
    fn admin_tokens_by_hash_and_scope() {
        let auth = AdminAuth::new(&AdminConfig {
            tokens: vec![
                AdminToken {
                    name: "viewer".into(),
                    sha256: hex::encode(hash("read-secret")),
                    scopes: vec![Scope::Read],
                },
                AdminToken {
                    name: "ops".into(),
                    sha256: hex::encode(hash("write-secret")),
                    scopes: vec![Scope::Write],
                },
            ],
            ..AdminConfig::default()
        });
        let check = |header: Option<&str>, scope| match auth.check(&metadata(header), scope) {
            Ok(identity) => identity,
            Err((identity, err)) => format!("{identity}: {:?}", err.code()),
        };
        assert_eq!(check(None, Scope::Read), "anonymous: Unauthenticated");
        assert_eq!(
            check(Some("Bearer nope"), Scope::Read),
            "anonymous: Unauthenticated"
        );
        assert_eq!(
            check(Some("Basic read-secret"), Scope::Read),
            "anonymous: Unauthenticated"
        );
        assert_eq!(
            check(Some("Bearer read-secret"), Scope::Read),
            "token:viewer"
        );
        assert_eq!(
            check(Some("bearer read-secret"), Scope::Read),
            "token:viewer"
        );
        assert_eq!(
            check(Some("Bearer read-secret"), Scope::Write),
            "token:viewer: PermissionDenied"
        );
        assert_eq!(
            check(Some("Bearer write-secret"), Scope::Write),
            "token:ops"
        );
        assert_eq!(check(Some("Bearer write-secret"), Scope::Read), "token:ops");
    }

    /// Test keys from fixed secrets, as PKCS#8 DER (what `EncodingKey` takes), so that no key
    /// generator is needed: an Ed25519 seed, or a P-256 scalar.
    fn ed25519_der(seed: u8) -> Vec<u8> {
        let mut der = hex::decode("302e020100300506032b657004220420").unwrap();
        der.extend([seed; 32]);
        der
    }
    fn p256_der(scalar: u8) -> Vec<u8> {
        let mut der = hex::decode(
            "3041020100301306072a8648ce3d020106082a8648ce3d0301070427302502010104 20"
                .replace(' ', ""),
        )
        .unwrap();
        der.extend([scalar; 32]);
        der
    }

    /// A signing key of the tests' provider: its `kid`, algorithm and private key.
    struct Signer {
        kid: &'static str,
        alg: Algorithm,
        key: EncodingKey,
    }

    impl Signer {
        fn ed(kid: &'static str, seed: u8) -> Signer {
            let key = EncodingKey::from_ed_der(&ed25519_der(seed));
            Signer {
                kid,
                alg: Algorithm::EdDSA,
                key,
            }
        }
        fn es(kid: &'static str, scalar: u8) -> Signer {
            let key = EncodingKey::from_ec_der(&p256_der(scalar));
            Signer {
                kid,
                alg: Algorithm::ES256,
                key,
            }
        }
        /// Its public half as a JWKS entry (with `alg` when `named`).
        fn jwk(&self, named: bool) -> Value {
            let mut jwk =
                serde_json::to_value(Jwk::from_encoding_key(&self.key, self.alg).unwrap()).unwrap();
            jwk["kid"] = self.kid.into();
            jwk["use"] = "sig".into();
            if !named {
                jwk.as_object_mut().unwrap().remove("alg");
            }
            jwk
        }
        /// A JWT of `claims` signed by this key, naming it.
        fn sign(&self, claims: &Value) -> String {
            let mut header = Header::new(self.alg);
            header.kid = Some(self.kid.into());
            jsonwebtoken::encode(&header, claims, &self.key).unwrap()
        }
    }

    const ISSUER: &str = "https://sso.example.org/realms/ops";
    const AUDIENCE: &str = "antidote-admin";

    fn unix_now() -> i64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    /// Valid claims for `sub` with `scope`, then `changes` applied (`null` removes a claim).
    fn claims(sub: &str, scope: Value, changes: Value) -> Value {
        let now = unix_now();
        let mut claims = serde_json::json!({
            "iss": ISSUER, "aud": AUDIENCE, "sub": sub, "scope": scope,
            "iat": now, "nbf": now, "exp": now + 300,
        });
        for (key, value) in changes.as_object().unwrap() {
            if value.is_null() {
                claims.as_object_mut().unwrap().remove(key);
            } else {
                claims[key] = value.clone();
            }
        }
        claims
    }

    fn write_jwks(path: &Path, keys: &[Value]) {
        std::fs::write(path, serde_json::json!({ "keys": keys }).to_string()).unwrap();
    }

    fn oidc_config(jwks_file: &Path) -> AdminConfig {
        AdminConfig {
            tokens: vec![AdminToken {
                name: "ops".into(),
                sha256: hex::encode(hash("write-secret")),
                scopes: vec![Scope::Write],
            }],
            oidc: Some(OidcConfig {
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                jwks_file: jwks_file.to_path_buf(),
                ..OidcConfig::default()
            }),
            ..AdminConfig::default()
        }
    }

    /// `identity`, or `identity: Code: message` of a refusal.
    fn outcome(auth: &AdminAuth, token: &str, scope: Scope, now: Instant) -> String {
        match auth.check_at(&metadata(Some(&format!("Bearer {token}"))), scope, now) {
            Ok(identity) => identity,
            Err((identity, err)) => {
                let message = match &err {
                    Error::Unauthenticated(reason) => reason.clone(),
                    other => other.to_string(),
                };
                assert!(
                    !message.contains(token),
                    "the refusal echoes the token: {message}"
                );
                format!("{identity}: {:?}: {message}", err.code())
            }
        }
    }

    #[test]
    fn oidc_jwts_by_key_issuer_audience_time_and_scope() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let (ed, es) = (Signer::ed("ed-1", 1), Signer::es("es-1", 7));
        write_jwks(&jwks, &[ed.jwk(true), es.jwk(false)]);
        let auth = AdminAuth::new(&oidc_config(&jwks));
        let (write, read) = (
            serde_json::json!("openid admin:write"),
            serde_json::json!(["admin:read"]),
        );
        let none = serde_json::json!({});
        let valid = ed.sign(&claims("alice", write.clone(), none.clone()));
        let (head, rest) = valid.split_once('.').unwrap();
        let (body, _signature) = rest.split_once('.').unwrap();
        // `{"alg":"none","typ":"JWT","kid":"ed-1"}`: an unsigned token.
        let unsigned = format!("eyJhbGciOiJub25lIiwidHlwIjoiSldUIiwia2lkIjoiZWQtMSJ9.{body}.");
        // The Ed25519 public key used as an HMAC secret: the classic confusion attack.
        let public_x = ed.jwk(true)["x"].as_str().unwrap().to_owned();
        let mut hmac_header = Header::new(Algorithm::HS256);
        hmac_header.kid = Some("ed-1".into());
        let hmac = jsonwebtoken::encode(
            &hmac_header,
            &claims("mallory", write.clone(), none.clone()),
            &EncodingKey::from_secret(public_x.as_bytes()).unwrap(),
        )
        .unwrap();
        let tampered_claims = ed.sign(&claims("mallory", write.clone(), none.clone()));
        let tampered = format!(
            "{head}.{}.{}",
            tampered_claims.split('.').nth(1).unwrap(),
            { valid.rsplit('.').next().unwrap() }
        );
        let mut no_kid_header = Header::new(Algorithm::EdDSA);
        no_kid_header.kid = None;
        let no_kid = jsonwebtoken::encode(
            &no_kid_header,
            &claims("alice", write.clone(), none.clone()),
            &ed.key,
        )
        .unwrap();
        let mut es_as_ed = Header::new(Algorithm::ES256);
        es_as_ed.kid = Some("ed-1".into());
        let es_as_ed = jsonwebtoken::encode(
            &es_as_ed,
            &claims("alice", write.clone(), none.clone()),
            &es.key,
        )
        .unwrap();
        let now = unix_now();
        let cases: Vec<(String, Scope, &str)> = vec![
            (valid.clone(), Scope::Write, "oidc:alice"),
            (valid.clone(), Scope::Read, "oidc:alice"),
            (
                es.sign(&claims("bob", read.clone(), none.clone())),
                Scope::Read,
                "oidc:bob",
            ),
            (
                es.sign(&claims("bob", read.clone(), none.clone())),
                Scope::Write,
                "oidc:bob: PermissionDenied: oidc:bob lacks scope `admin:write`",
            ),
            (
                ed.sign(&claims("carol", serde_json::json!(null), none.clone())),
                Scope::Read,
                "oidc:carol: PermissionDenied",
            ),
            (
                ed.sign(&claims(
                    "dave",
                    serde_json::json!("openid admin:readonly"),
                    none.clone(),
                )),
                Scope::Read,
                "oidc:dave: PermissionDenied",
            ),
            // Within the leeway.
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"exp": now - 10}),
                )),
                Scope::Write,
                "oidc:alice",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"exp": now - 120}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT has expired (`exp`)",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"exp": null}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT has no `exp` claim",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"nbf": now + 300}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT is not valid yet (`nbf`)",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"aud": "grafana"}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's audience (`aud`) is not `antidote-admin`",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"aud": null}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT has no `aud` claim",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"iss": "https://evil.example"}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's issuer (`iss`) is not `https://sso.example.org/realms/ops`",
            ),
            (
                ed.sign(&claims(
                    "alice",
                    write.clone(),
                    serde_json::json!({"sub": null}),
                )),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT has no `sub` claim naming the caller",
            ),
            (
                Signer::ed("ed-9", 9).sign(&claims("alice", write.clone(), none.clone())),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's signing key `ed-9` is not in the JWKS",
            ),
            (
                Signer::ed("ed-1", 2).sign(&claims("alice", write.clone(), none.clone())),
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's signature does not verify with key `ed-1`",
            ),
            (
                tampered,
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's signature does not verify with key `ed-1`",
            ),
            (
                unsigned,
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's header is unreadable or names an algorithm never accepted",
            ),
            (
                hmac,
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's algorithm HS256 is not one key `ed-1` is for",
            ),
            (
                es_as_ed,
                Scope::Write,
                "anonymous: Unauthenticated: the JWT's algorithm ES256 is not one key `ed-1` is for",
            ),
            (
                no_kid,
                Scope::Write,
                "anonymous: Unauthenticated: the JWT names no signing key (`kid`)",
            ),
            // Static tokens first; anything else not shaped like a JWT is simply unknown.
            ("write-secret".into(), Scope::Write, "token:ops"),
            (
                "not.a.jwt!".into(),
                Scope::Write,
                "anonymous: Unauthenticated: the bearer token is not one this scheduler knows",
            ),
        ];
        let at = Instant::now();
        for (token, scope, expected) in cases {
            let got = outcome(&auth, &token, scope, at);
            assert!(
                got.starts_with(expected),
                "expected `{expected}`, got `{got}`"
            );
        }

        // Without `admin.oidc`, a JWT is just an unknown token.
        let static_only = AdminAuth::new(&AdminConfig {
            oidc: None,
            ..oidc_config(&jwks)
        });
        assert_eq!(
            outcome(&static_only, &valid, Scope::Read, at),
            "anonymous: Unauthenticated: the bearer token is not one this scheduler knows"
        );

        // Other claims, as configured: roles as an array, the caller by email.
        let mut config = oidc_config(&jwks);
        let oidc = config.oidc.as_mut().unwrap();
        oidc.scope_claim = "roles".into();
        oidc.identity_claim = "email".into();
        let custom = AdminAuth::new(&config);
        let token = ed.sign(&claims(
            "alice",
            write.clone(),
            serde_json::json!({"roles": ["admin:read"], "email": "ops@example.org"}),
        ));
        assert_eq!(
            outcome(&custom, &token, Scope::Read, at),
            "oidc:ops@example.org"
        );
        assert!(
            outcome(&custom, &token, Scope::Write, at).contains("PermissionDenied"),
            "`scope` is not the configured claim"
        );
    }

    #[test]
    fn rotated_jwks_is_read_when_it_changes_or_names_a_new_key() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let (old, new) = (Signer::ed("ed-1", 1), Signer::ed("ed-1", 2));
        write_jwks(&jwks, &[old.jwk(true)]);
        let start = Instant::now();
        let auth = AdminAuth::new(&oidc_config(&jwks));
        let at = |secs: f64| start + Duration::from_secs_f64(secs);
        let write = serde_json::json!("admin:write");
        let new_token = new.sign(&claims("alice", write.clone(), serde_json::json!({})));
        let old_token = old.sign(&claims("alice", write.clone(), serde_json::json!({})));
        assert_eq!(
            outcome(&auth, &old_token, Scope::Write, at(0.0)),
            "oidc:alice"
        );

        // A new key under the same `kid`: seen once the file's modification time is looked at
        // again, not before. (The time is set, since a rewrite within the file system's clock
        // tick would keep it.)
        write_jwks(&jwks, &[new.jwk(true)]);
        let file = std::fs::File::options().write(true).open(&jwks).unwrap();
        file.set_modified(SystemTime::now() + Duration::from_secs(60))
            .unwrap();
        assert!(outcome(&auth, &new_token, Scope::Write, at(1.0)).contains("signature"));
        assert_eq!(
            outcome(&auth, &new_token, Scope::Write, at(6.0)),
            "oidc:alice"
        );
        assert!(outcome(&auth, &old_token, Scope::Write, at(6.0)).contains("signature"));

        // A new `kid`: the file is read at once, but at most once a second.
        let (second, third) = (Signer::es("es-2", 3), Signer::es("es-3", 4));
        write_jwks(&jwks, &[new.jwk(true), second.jwk(true)]);
        let token = second.sign(&claims("bob", write.clone(), serde_json::json!({})));
        assert_eq!(outcome(&auth, &token, Scope::Write, at(7.0)), "oidc:bob");
        write_jwks(&jwks, &[new.jwk(true), second.jwk(true), third.jwk(true)]);
        let token = third.sign(&claims("carol", write.clone(), serde_json::json!({})));
        assert!(outcome(&auth, &token, Scope::Write, at(7.5)).contains("not in the JWKS"));
        assert_eq!(outcome(&auth, &token, Scope::Write, at(8.1)), "oidc:carol");

        // A broken file (half-written, say) keeps the keys we have.
        std::fs::write(&jwks, "{\"keys\": [").unwrap();
        assert_eq!(outcome(&auth, &token, Scope::Write, at(20.0)), "oidc:carol");
    }

    #[test]
    fn jwks_keys_that_cannot_verify_are_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let ed = Signer::ed("ed-1", 1);
        let mut encryption = Signer::ed("enc-1", 2).jwk(true);
        encryption["use"] = "enc".into();
        let mut mislabelled = Signer::es("es-1", 3).jwk(true);
        mislabelled["alg"] = "RS256".into();
        let mut no_kid = Signer::ed("x", 4).jwk(true);
        no_kid.as_object_mut().unwrap().remove("kid");
        write_jwks(
            &jwks,
            &[
                ed.jwk(false),
                encryption,
                mislabelled,
                no_kid,
                serde_json::json!({"kty": "oct", "kid": "hmac-1", "k": "c2VjcmV0"}),
                serde_json::json!({"kty": "weird", "kid": "w-1"}),
                Signer::es("es-2", 5).jwk(true),
            ],
        );
        let config = oidc_config(&jwks);
        let keys = load_jwks(&jwks, config.oidc.as_ref().unwrap()).unwrap();
        let mut kids: Vec<&str> = keys.keys().map(String::as_str).collect();
        kids.sort();
        assert_eq!(kids, ["ed-1", "es-2"]);
        assert_eq!(keys["ed-1"].validation.algorithms, [Algorithm::EdDSA]);
        assert_eq!(keys["es-2"].validation.algorithms, [Algorithm::ES256]);
    }

    #[test]
    fn jwt_shape() {
        for (token, jwt) in [
            ("eyJh.eyJz.c2ln", true),
            ("eyJh.eyJz.", true),
            ("eyJh..c2ln", false),
            ("eyJh.eyJz", false),
            ("a.b.c.d", false),
            ("eyJh.eyJz.c2l+", false),
            ("ast_0123", false),
        ] {
            assert_eq!(looks_like_jwt(token), jwt, "{token}");
        }
    }

    #[test]
    fn session_tokens_are_random_and_stored_as_their_hash() {
        let (a, hash_a) = new_session_token().unwrap();
        let (b, _) = new_session_token().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with("ast_") && a.len() == 4 + 64, "{a}");
        assert_eq!(hash(&a), hash_a);
    }
}
