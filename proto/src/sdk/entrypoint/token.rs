//! Entrypoint tokens: EdDSA (Ed25519) JWTs the scheduler signs for one live lesson, endpoint and
//! presentation, verified by the agent's entrypoint with a key set chosen by the header's `kid`.
//!
//! The scheduler holds [`Signer`]s (its current key signs, older ones only verify); every agent
//! holds [`Keys`] (public keys by id, from its flags and from every handshake). Keys are raw
//! Ed25519: private keys as PKCS#8 PEM (`openssl genpkey -algorithm ed25519`), public keys as
//! SPKI PEM (`openssl pkey -pubout`) or 32 bytes (the handshake's `EntrypointKey`).

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{PrivateKeyDer, SubjectPublicKeyInfoDer};
use serde::{Deserialize, Serialize};

/// The `aud` of every entrypoint token: a token signed for anything else never admits.
pub const AUDIENCE: &str = "antidote-entrypoint";

/// How far a token's `exp` may lie behind the agent's clock and still admit: clocks of the
/// scheduler's and the agent's hosts differ a little.
pub const LEEWAY: Duration = Duration::from_secs(5);

/// PKCS#8 v1 of an Ed25519 private key: this prefix, then the 32-byte seed (RFC 8410).
const PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
/// SubjectPublicKeyInfo of an Ed25519 public key: this prefix, then the 32-byte key.
const SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// What a token admits to, and until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// The live lesson id.
    pub ll: String,
    /// The endpoint's name.
    pub ep: String,
    /// The presentation's name.
    pub pr: String,
    /// Expiry, seconds since the epoch.
    pub exp: u64,
    /// Issue time, seconds since the epoch.
    pub iat: u64,
    /// Always [`AUDIENCE`].
    pub aud: String,
}

impl Claims {
    /// Claims for one presentation, valid for `ttl` from now.
    pub fn new(live_lesson: &str, endpoint: &str, presentation: &str, ttl: Duration) -> Claims {
        let now = unix(SystemTime::now());
        Claims {
            ll: live_lesson.to_owned(),
            ep: endpoint.to_owned(),
            pr: presentation.to_owned(),
            exp: now + ttl.as_secs().max(1),
            iat: now,
            aud: AUDIENCE.to_owned(),
        }
    }

    /// Whether the token is for exactly this presentation.
    pub fn admits(&self, live_lesson: &str, endpoint: &str, presentation: &str) -> bool {
        self.ll == live_lesson && self.ep == endpoint && self.pr == presentation
    }
}

/// Why a token does not admit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// A key file or key bytes that are not an Ed25519 key.
    #[error("not an Ed25519 key: {0}")]
    Key(String),
    /// No token in the request.
    #[error("no token")]
    Missing,
    /// Not a JWT, or one without a `kid`.
    #[error("malformed token: {0}")]
    Malformed(String),
    /// A `kid` no key of the set has.
    #[error("token signed with unknown key `{0}`")]
    UnknownKey(String),
    /// Past its `exp`.
    #[error("token expired")]
    Expired,
    /// A bad signature, another audience, another algorithm.
    #[error("invalid token: {0}")]
    Invalid(String),
}

fn unix(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A signing key: the scheduler's.
pub struct Signer {
    /// The `kid` of the tokens it signs.
    key_id: String,
    /// The PKCS#8 DER jsonwebtoken signs with.
    encoding: EncodingKey,
    /// Its public half, sent at handshake.
    public: [u8; 32],
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// A key from its 32-byte seed.
    pub fn from_seed(key_id: &str, seed: [u8; 32]) -> Signer {
        let mut der = PKCS8_PREFIX.to_vec();
        der.extend_from_slice(&seed);
        let public = ed25519_dalek::SigningKey::from_bytes(&seed)
            .verifying_key()
            .to_bytes();
        Signer {
            key_id: key_id.to_owned(),
            encoding: EncodingKey::from_ed_der(&der),
            public,
        }
    }

    /// A key from PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`, what `openssl genpkey -algorithm
    /// ed25519` writes).
    pub fn from_pem(key_id: &str, pem: &[u8]) -> Result<Signer, TokenError> {
        let der = PrivateKeyDer::from_pem_slice(pem)
            .map_err(|err| TokenError::Key(format!("no PRIVATE KEY PEM block: {err}")))?;
        let PrivateKeyDer::Pkcs8(der) = der else {
            return Err(TokenError::Key("not PKCS#8".into()));
        };
        let der = der.secret_pkcs8_der();
        if der.len() < 48 || der[..16] != PKCS8_PREFIX {
            return Err(TokenError::Key("not an Ed25519 PKCS#8 key".into()));
        }
        let mut seed = [0u8; 32];
        seed.copy_from_slice(&der[16..48]);
        Ok(Signer::from_seed(key_id, seed))
    }

    /// A fresh random key (tests, and a scheduler told to make one).
    pub fn generate(key_id: &str) -> Signer {
        let mut seed = [0u8; 32];
        for chunk in seed.chunks_mut(16) {
            chunk.copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        }
        Signer::from_seed(key_id, seed)
    }

    /// The key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The public key (32 bytes).
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// A signed token carrying `claims`.
    pub fn sign(&self, claims: &Claims) -> String {
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(self.key_id.clone());
        // The key was checked when it was built and the claims always serialise; signing with
        // an Ed25519 key cannot fail otherwise.
        jsonwebtoken::encode(&header, claims, &self.encoding)
            .expect("an Ed25519 key signs any claims")
    }
}

/// The public keys an entrypoint trusts, by key id. Shared: the handshake adds the scheduler's
/// keys while the listener verifies.
#[derive(Debug, Default)]
pub struct Keys {
    /// Raw Ed25519 public keys by `kid`.
    keys: RwLock<HashMap<String, [u8; 32]>>,
}

impl Keys {
    /// Adds (or replaces) a key.
    pub fn insert(&self, key_id: &str, public: [u8; 32]) {
        self.keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key_id.to_owned(), public);
    }

    /// Adds a key of 32 raw bytes (the handshake's form).
    pub fn insert_bytes(&self, key_id: &str, public: &[u8]) -> Result<(), TokenError> {
        let public: [u8; 32] = public
            .try_into()
            .map_err(|_| TokenError::Key(format!("{} bytes, not 32", public.len())))?;
        self.insert(key_id, public);
        Ok(())
    }

    /// Adds a key from SPKI PEM (`-----BEGIN PUBLIC KEY-----`, `openssl pkey -pubout`).
    pub fn insert_pem(&self, key_id: &str, pem: &[u8]) -> Result<(), TokenError> {
        let der = SubjectPublicKeyInfoDer::from_pem_slice(pem)
            .map_err(|err| TokenError::Key(format!("no PUBLIC KEY PEM block: {err}")))?;
        if der.len() != 44 || der[..12] != SPKI_PREFIX {
            return Err(TokenError::Key("not an Ed25519 public key".into()));
        }
        self.insert_bytes(key_id, &der[12..])
    }

    /// How many keys it holds.
    pub fn len(&self) -> usize {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether it holds none (then nothing is admitted).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The claims of a token signed by one of the keys, for [`AUDIENCE`], not expired.
    pub fn verify(&self, token: &str) -> Result<Claims, TokenError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|err| TokenError::Malformed(err.to_string()))?;
        let kid = header
            .kid
            .ok_or_else(|| TokenError::Malformed("no kid".into()))?;
        let public = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&kid)
            .copied()
            .ok_or_else(|| TokenError::UnknownKey(kid.clone()))?;
        let mut validation = Validation::new(Algorithm::EdDSA);
        validation.set_audience(&[AUDIENCE]);
        validation.set_required_spec_claims(&["exp", "aud"]);
        validation.leeway = LEEWAY.as_secs();
        let data =
            jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_ed_der(&public), &validation)
                .map_err(|err| match err.kind() {
                    jsonwebtoken::errors::ErrorKind::ExpiredSignature => TokenError::Expired,
                    _ => TokenError::Invalid(err.to_string()),
                })?;
        Ok(data.claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(ttl: Duration) -> Claims {
        Claims::new("ll", "ep", "pr", ttl)
    }

    #[test]
    fn signed_tokens_verify_by_key_id() {
        let old = Signer::generate("k1");
        let new = Signer::generate("k2");
        let keys = Keys::default();
        keys.insert("k1", old.public_key());
        keys.insert("k2", new.public_key());
        for signer in [&old, &new] {
            let got = keys.verify(&signer.sign(&claims(Duration::from_secs(60))));
            assert_eq!(got.unwrap(), claims(Duration::from_secs(60)));
        }
    }

    #[test]
    fn refusals() {
        let signer = Signer::generate("k1");
        let keys = Keys::default();
        keys.insert("k1", signer.public_key());
        let mut expired = claims(Duration::from_secs(60));
        expired.exp = unix(SystemTime::now()) - 60;
        assert_eq!(
            keys.verify(&signer.sign(&expired)),
            Err(TokenError::Expired)
        );
        let mut other = claims(Duration::from_secs(60));
        other.aud = "someone-else".into();
        assert!(matches!(
            keys.verify(&signer.sign(&other)),
            Err(TokenError::Invalid(_))
        ));
        let stranger = Signer::generate("k9");
        assert_eq!(
            keys.verify(&stranger.sign(&claims(Duration::from_secs(60)))),
            Err(TokenError::UnknownKey("k9".into()))
        );
        // The right kid, the wrong key.
        let impostor = Signer::generate("k1");
        assert!(matches!(
            keys.verify(&impostor.sign(&claims(Duration::from_secs(60)))),
            Err(TokenError::Invalid(_))
        ));
        assert!(matches!(
            keys.verify("not.a.token"),
            Err(TokenError::Malformed(_))
        ));
    }

    #[test]
    fn pem_keys() {
        // `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` of it.
        let private = b"-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIOJpnp+MXLCEBFZDaMoT0KXNBLMvX5FYtd/znqWpkio2
-----END PRIVATE KEY-----
";
        let public = b"-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEAirIIJzFxo0jgdOW4nv+lyOAn1PYsR5AGv5JO03j6eDM=
-----END PUBLIC KEY-----
";
        let signer = Signer::from_pem("k", private).unwrap();
        let keys = Keys::default();
        keys.insert_pem("k", public).unwrap();
        assert!(
            keys.verify(&signer.sign(&claims(Duration::from_secs(5))))
                .is_ok()
        );
        assert!(Signer::from_pem("k", b"garbage").is_err());
        assert!(keys.insert_pem("k", private).is_err());
        assert!(keys.insert_bytes("k", &[1, 2, 3]).is_err());
    }
}
