//! Entrypoint tokens: EdDSA (Ed25519) JWTs the scheduler signs for one live lesson, endpoint and
//! presentation, verified by the agent's entrypoint with a key set chosen by the header's `kid`.
//!
//! The scheduler holds [`Signer`]s (its current key signs, older ones only verify); every agent
//! holds [`Keys`] (public keys by id: its flags' for good, and each scheduler instance's latest
//! handshake's, so a key the scheduler stops offering stops verifying without a restart). Keys are raw
//! Ed25519: private keys as PKCS#8 PEM (`openssl genpkey -algorithm ed25519`), public keys as
//! SPKI PEM (`openssl pkey -pubout`) or 32 bytes (the handshake's `EntrypointKey`).

use std::collections::{HashMap, HashSet};
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{PrivateKeyDer, SubjectPublicKeyInfoDer};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// The `aud` of every entrypoint token: a token signed for anything else never admits.
pub const AUDIENCE: &str = "antidote-entrypoint";

/// How far a token's `exp` may lie behind the agent's clock and still admit: clocks of the
/// scheduler's and the agent's hosts differ a little.
pub const LEEWAY: Duration = Duration::from_secs(5);

/// The longest a token may still have to live by default (`--entrypoint-max-token-lifetime`):
/// the scheduler's `token_ttl` is at most half of it.
pub const MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);

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
    /// The scheduler instance whose key signed it (its `instance_id`, the Handshake's
    /// `scheduler_instance_id`): only that instance's keys (and the operator's) verify it.
    /// Absent from older schedulers' tokens: then any instance's key of its `kid` may.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
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
            iss: None,
        }
    }

    /// The claims, naming scheduler instance `instance` as their issuer.
    pub fn issued_by(mut self, instance: &str) -> Claims {
        self.iss = Some(instance.to_owned());
        self
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
    /// Its `exp` lies further ahead (of now, or of its `iat`) than the entrypoint lets a token
    /// live.
    #[error("token lives too long: its exp is more than {0:?} ahead")]
    TooLong(Duration),
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

/// Whose a key is: a scheduler instance's (by its id), or the operator's (`None`).
type Owner = Option<String>;

/// One trusted public key: whose, its id and its 32 bytes.
type KeyRef = (Owner, String, [u8; 32]);

/// The public keys an entrypoint trusts, by key id: those its operator configured (kept for the
/// process's life) and, per scheduler instance id, the set that instance's latest handshake
/// offered (replaced wholesale by its next handshake). Replicas of one scheduler share an
/// instance id and one configured key set, so their latest handshake is their set; independent
/// schedulers sharing the agent each keep theirs. Keys are bound to their instance: a token
/// naming an instance (`iss`) is verified only by that instance's keys (or the operator's),
/// and an instance's revocations touch only the keys it offered, so a stranger's Handshake
/// under another instance id can neither sign for the real scheduler nor revoke its keys
/// ([`Admitted::instance`] tells the entrypoint whose key admitted, for the live lesson's
/// owner to be checked). A key no set holds any more is retired: its tokens are refused from
/// then on, but what it admitted goes on. A key its instance's handshake revokes is refused,
/// and what it admitted is told to end ([`Admitted::withdrawn`]). Shared: handshakes change it
/// while the listener verifies.
#[derive(Debug)]
pub struct Keys {
    inner: RwLock<KeySets>,
    /// Bumped by every change of the sets ([`Keys::generation`]).
    generation: AtomicU64,
    /// The longest a token may still have to live when presented: a key holder cannot mint
    /// a token that outlives every rotation and revocation plan.
    max_lifetime: Duration,
}

impl Default for Keys {
    fn default() -> Self {
        Keys::with_max_lifetime(MAX_LIFETIME)
    }
}

#[derive(Debug, Default)]
struct KeySets {
    /// The operator's keys (`--entrypoint-key`), by `kid`.
    configured: HashMap<String, [u8; 32]>,
    /// Each scheduler instance's latest offer, by instance id, then `kid`.
    offered: HashMap<String, HashMap<String, [u8; 32]>>,
    /// The key ids each scheduler instance's latest handshake revoked, among its own keys.
    revoked: HashMap<String, HashSet<String>>,
    /// One token per key that admitted or admits (trusted or retired), cancelled when the key
    /// is revoked.
    withdrawn: HashMap<KeyRef, CancellationToken>,
}

impl KeySets {
    /// Whether `owner` revoked its key `kid` (the operator's keys are never revoked by a
    /// scheduler: they leave with the flag).
    fn is_revoked(&self, owner: &Owner, kid: &str) -> bool {
        owner
            .as_ref()
            .and_then(|instance| self.revoked.get(instance))
            .is_some_and(|ids| ids.contains(kid))
    }

    /// Every trusted public key of `kid` with its owner: the operator's, then each instance's
    /// that has not revoked it (normally one in all).
    fn candidates(&self, kid: &str) -> Vec<(Owner, [u8; 32])> {
        let mut found: Vec<(Owner, [u8; 32])> = self
            .configured
            .get(kid)
            .map(|public| (None, *public))
            .into_iter()
            .collect();
        let mut instances: Vec<(&String, &HashMap<String, [u8; 32]>)> =
            self.offered.iter().collect();
        instances.sort_by_key(|(instance, _)| *instance);
        for (instance, set) in instances {
            let owner = Some(instance.clone());
            if let Some(public) = set.get(kid)
                && !self.is_revoked(&owner, kid)
            {
                found.push((owner, *public));
            }
        }
        found
    }

    /// Brings `withdrawn` in line with the sets: new keys get a token; revoked keys have
    /// theirs cancelled (and are forgotten); keys no set holds any more (retired) keep theirs,
    /// so what they admitted goes on until a revocation. Returns the ids of the revoked keys
    /// whose tokens were cancelled now.
    fn settle(&mut self) -> Vec<String> {
        let mut trusted: HashSet<KeyRef> = self
            .configured
            .iter()
            .map(|(kid, public)| (None, kid.clone(), *public))
            .collect();
        for (instance, set) in &self.offered {
            trusted.extend(
                set.iter()
                    .map(|(kid, public)| (Some(instance.clone()), kid.clone(), *public)),
            );
        }
        trusted.retain(|(owner, kid, _)| !self.is_revoked(owner, kid));
        let mut gone = Vec::new();
        let revoked = &self.revoked;
        self.withdrawn.retain(|(owner, kid, _), token| {
            let is_revoked = owner
                .as_ref()
                .and_then(|instance| revoked.get(instance))
                .is_some_and(|ids| ids.contains(kid));
            if is_revoked {
                token.cancel();
                gone.push(kid.clone());
            }
            !is_revoked
        });
        for key in trusted {
            self.withdrawn.entry(key).or_default();
        }
        gone.sort();
        gone
    }
}

/// What a verified token admitted, and the signal that its key was withdrawn.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The token's claims.
    pub claims: Claims,
    /// Cancelled when the key that verified the token is revoked: connections it admitted
    /// (terminals, proxied WebSockets) end then. A key that merely leaves the key set
    /// (retired) cancels nothing.
    pub withdrawn: CancellationToken,
    /// The scheduler instance whose key verified the token; `None`: a key the operator
    /// configured. A live lesson another instance placed is not this token's to admit.
    pub instance: Option<String>,
}

impl Keys {
    fn sets(&self) -> std::sync::RwLockReadGuard<'_, KeySets> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The sets, to change them: every change goes through here and bumps the generation
    /// (while the write lock is held, so a reader that sees the new generation verifies
    /// against the changed sets).
    fn sets_mut(&self) -> std::sync::RwLockWriteGuard<'_, KeySets> {
        let sets = self.inner.write().unwrap_or_else(|p| p.into_inner());
        self.generation.fetch_add(1, Ordering::SeqCst);
        sets
    }

    /// An empty key set admitting tokens that live at most `max_lifetime`.
    pub fn with_max_lifetime(max_lifetime: Duration) -> Keys {
        Keys {
            inner: RwLock::default(),
            generation: AtomicU64::new(0),
            max_lifetime,
        }
    }

    /// A number that changes whenever the key set may have changed (keys added, replaced,
    /// retired, revoked): what the entrypoint's cache of verified tokens is valid for.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Adds (or replaces) a key the operator configured.
    pub fn insert(&self, key_id: &str, public: [u8; 32]) {
        let mut sets = self.sets_mut();
        sets.configured.insert(key_id.to_owned(), public);
        sets.settle();
    }

    /// Adds a configured key of 32 raw bytes.
    pub fn insert_bytes(&self, key_id: &str, public: &[u8]) -> Result<(), TokenError> {
        self.insert(key_id, raw_key(public)?);
        Ok(())
    }

    /// Adds a configured key from SPKI PEM (`-----BEGIN PUBLIC KEY-----`, `openssl pkey
    /// -pubout`).
    pub fn insert_pem(&self, key_id: &str, pem: &[u8]) -> Result<(), TokenError> {
        let der = SubjectPublicKeyInfoDer::from_pem_slice(pem)
            .map_err(|err| TokenError::Key(format!("no PUBLIC KEY PEM block: {err}")))?;
        if der.len() != 44 || der[..12] != SPKI_PREFIX {
            return Err(TokenError::Key("not an Ed25519 public key".into()));
        }
        self.insert_bytes(key_id, &der[12..])
    }

    /// [`Keys::offer_revoking`] revoking nothing.
    pub fn offer<'a>(&self, instance: &str, keys: impl IntoIterator<Item = (&'a str, &'a [u8])>) {
        self.offer_revoking(instance, keys, []);
    }

    /// A handshake from scheduler instance `instance` offered `keys` (`kid`, 32 raw bytes) and
    /// revoked the key ids `revoked`: they replace that instance's previous offer and
    /// revocations. Keys no set holds any more are retired (refused; what they admitted goes
    /// on); revoked keys are refused and what they admitted ends. A key that is not 32 bytes is
    /// left out (and logged).
    pub fn offer_revoking<'a>(
        &self,
        instance: &str,
        keys: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        revoked: impl IntoIterator<Item = &'a str>,
    ) {
        let revoked: HashSet<String> = revoked.into_iter().map(str::to_owned).collect();
        let mut offer = HashMap::new();
        for (kid, public) in keys {
            match raw_key(public) {
                Ok(public) => {
                    offer.insert(kid.to_owned(), public);
                }
                Err(err) => {
                    tracing::warn!(key_id = %kid, scheduler_instance = %instance, error = %err, "ignored a scheduler entrypoint key");
                }
            }
        }
        let mut sets = self.sets_mut();
        if !offer.is_empty() && !sets.offered.contains_key(instance) {
            let others: Vec<&String> = sets.offered.keys().collect();
            if !others.is_empty() {
                // Anyone who reaches the agent's port can handshake: a second instance's keys
                // are worth an operator's look (they admit only to that instance's lessons).
                tracing::warn!(scheduler_instance = %instance, known_instances = ?others, "a scheduler instance not seen before brings entrypoint keys");
            }
        }
        let before: Option<Vec<String>> = sets.offered.get(instance).map(|set| {
            let mut ids: Vec<String> = set.keys().cloned().collect();
            ids.sort();
            ids
        });
        let mut ids: Vec<String> = offer.keys().cloned().collect();
        ids.sort();
        if offer.is_empty() {
            sets.offered.remove(instance);
        } else {
            sets.offered.insert(instance.to_owned(), offer);
        }
        if revoked.is_empty() {
            sets.revoked.remove(instance);
        } else {
            sets.revoked.insert(instance.to_owned(), revoked);
        }
        let withdrawn = sets.settle();
        drop(sets);
        if before.as_ref() != Some(&ids) || !withdrawn.is_empty() {
            tracing::info!(scheduler_instance = %instance, offered = ?ids, revoked = ?withdrawn, "entrypoint keys from the scheduler's handshake");
        }
    }

    /// How many keys it trusts.
    pub fn len(&self) -> usize {
        let sets = self.sets();
        let mut trusted: HashSet<&String> = sets.configured.keys().collect();
        for (instance, set) in &sets.offered {
            let owner = Some(instance.clone());
            trusted.extend(set.keys().filter(|kid| !sets.is_revoked(&owner, kid)));
        }
        trusted.len()
    }

    /// Whether it holds none (then nothing is admitted).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The claims of a token signed by one of the keys, for [`AUDIENCE`], not expired.
    pub fn verify(&self, token: &str) -> Result<Claims, TokenError> {
        self.admit(token).map(|admitted| admitted.claims)
    }

    /// [`Keys::verify`], with the signal of the verifying key's withdrawal.
    pub fn admit(&self, token: &str) -> Result<Admitted, TokenError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|err| TokenError::Malformed(err.to_string()))?;
        let kid = header
            .kid
            .ok_or_else(|| TokenError::Malformed("no kid".into()))?;
        let candidates = self.sets().candidates(&kid);
        if candidates.is_empty() {
            return Err(TokenError::UnknownKey(kid));
        }
        let mut validation = Validation::new(Algorithm::EdDSA);
        validation.set_audience(&[AUDIENCE]);
        validation.set_required_spec_claims(&["exp", "aud"]);
        validation.leeway = LEEWAY.as_secs();
        let mut refusal = None;
        for (owner, public) in candidates {
            match jsonwebtoken::decode::<Claims>(
                token,
                &DecodingKey::from_ed_der(&public),
                &validation,
            ) {
                // A token naming its instance is verified by that instance's keys (and the
                // operator's) only: another instance's key under the same `kid` is no key of
                // its.
                Ok(data)
                    if owner.is_some() && data.claims.iss.is_some() && data.claims.iss != owner =>
                {
                    refusal.get_or_insert(TokenError::Invalid(format!(
                        "signed by a key of another scheduler instance than its iss `{}`",
                        data.claims.iss.unwrap_or_default()
                    )));
                }
                Ok(data) => {
                    // The key may have been withdrawn since the candidates were read: then its
                    // token is already cancelled, and so is what it admits.
                    let withdrawn = self
                        .sets()
                        .withdrawn
                        .get(&(owner.clone(), kid.clone(), public))
                        .cloned()
                        .unwrap_or_else(|| {
                            let token = CancellationToken::new();
                            token.cancel();
                            token
                        });
                    if withdrawn.is_cancelled() {
                        return Err(TokenError::UnknownKey(kid));
                    }
                    let max = self.max_lifetime.as_secs();
                    let claims = &data.claims;
                    if claims.exp > unix(SystemTime::now()) + max + LEEWAY.as_secs()
                        || claims.exp.saturating_sub(claims.iat) > max + LEEWAY.as_secs()
                    {
                        return Err(TokenError::TooLong(self.max_lifetime));
                    }
                    return Ok(Admitted {
                        claims: data.claims,
                        withdrawn,
                        instance: owner,
                    });
                }
                // Expiry is checked after the signature: this key signed it.
                Err(err)
                    if matches!(
                        err.kind(),
                        jsonwebtoken::errors::ErrorKind::ExpiredSignature
                    ) =>
                {
                    return Err(TokenError::Expired);
                }
                Err(err) => {
                    refusal.get_or_insert(TokenError::Invalid(err.to_string()));
                }
            }
        }
        Err(refusal.unwrap_or(TokenError::UnknownKey(kid)))
    }
}

/// 32 raw bytes as an Ed25519 public key.
fn raw_key(public: &[u8]) -> Result<[u8; 32], TokenError> {
    public
        .try_into()
        .map_err(|_| TokenError::Key(format!("{} bytes, not 32", public.len())))
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
        // A token signed to live ten years, or back-dated to look young, is refused.
        let keys = Keys::with_max_lifetime(Duration::from_secs(1200));
        keys.insert("k1", signer.public_key());
        let decade = claims(Duration::from_secs(10 * 365 * 86400));
        assert_eq!(
            keys.verify(&signer.sign(&decade)),
            Err(TokenError::TooLong(Duration::from_secs(1200)))
        );
        let mut backdated = claims(Duration::from_secs(600));
        backdated.iat -= 3600;
        assert!(matches!(
            keys.verify(&signer.sign(&backdated)),
            Err(TokenError::TooLong(_))
        ));
        assert!(
            keys.verify(&signer.sign(&claims(Duration::from_secs(1200))))
                .is_ok()
        );
    }

    #[test]
    fn handshakes_replace_their_instances_keys_retire_the_rest_and_revoke_what_they_name() {
        let (k1, k2, k3) = (
            Signer::generate("k1"),
            Signer::generate("k2"),
            Signer::generate("k3"),
        );
        let token = |s: &Signer| s.sign(&claims(Duration::from_secs(60)));
        let keys = Keys::default();
        let configured = Signer::generate("op");
        keys.insert("op", configured.public_key());
        let (p1, p2, p3) = (k1.public_key(), k2.public_key(), k3.public_key());
        keys.offer_revoking("a", [("k1", &p1[..])], []);
        let admitted = keys.admit(&token(&k1)).unwrap();
        // Rotation: adding k2 keeps k1 and what it admitted.
        keys.offer_revoking("a", [("k1", &p1[..]), ("k2", &p2[..])], []);
        assert!(!admitted.withdrawn.is_cancelled());
        assert!(keys.verify(&token(&k1)).is_ok());
        let by_k2 = keys.admit(&token(&k2)).unwrap();
        // Another scheduler instance's offer leaves instance a's keys alone.
        keys.offer_revoking("b", [("k3", &p3[..]), ("bad", &[1u8, 2][..])], []);
        assert!(keys.verify(&token(&k1)).is_ok() && keys.verify(&token(&k3)).is_ok());
        assert_eq!(keys.len(), 4);
        // k1 removed from instance a's set (retired): refused from now on, but what it
        // admitted goes on.
        keys.offer_revoking("a", [("k2", &p2[..])], []);
        assert!(!admitted.withdrawn.is_cancelled());
        assert_eq!(
            keys.verify(&token(&k1)),
            Err(TokenError::UnknownKey("k1".into()))
        );
        assert!(!by_k2.withdrawn.is_cancelled());
        assert!(keys.verify(&token(&k2)).is_ok());
        assert_eq!(keys.len(), 3);
        // k1 revoked: what it admitted is told to end; k2's goes on.
        keys.offer_revoking("a", [("k2", &p2[..])], ["k1"]);
        assert!(admitted.withdrawn.is_cancelled());
        assert!(!by_k2.withdrawn.is_cancelled());
        // An instance revokes its own keys only: b holding the same key goes on verifying
        // tokens that name no instance, or b, but never those naming a.
        keys.offer_revoking("b", [("k3", &p3[..]), ("k1", &p1[..])], []);
        assert_eq!(
            keys.admit(&token(&k1)).unwrap().instance.as_deref(),
            Some("b")
        );
        let naming = |s: &Signer, instance: &str| {
            s.sign(&claims(Duration::from_secs(60)).issued_by(instance))
        };
        assert!(keys.verify(&naming(&k1, "b")).is_ok());
        assert!(matches!(
            keys.verify(&naming(&k1, "a")),
            Err(TokenError::Invalid(_))
        ));
        keys.offer_revoking("b", [("k3", &p3[..])], []);
        assert_eq!(
            keys.verify(&token(&k1)),
            Err(TokenError::UnknownKey("k1".into()))
        );
        // Revoking a key that admitted nothing and is held nowhere is harmless.
        keys.offer_revoking("a", [("k2", &p2[..])], ["k1", "never-seen"]);
        assert!(keys.verify(&token(&k2)).is_ok());
        // A kid offered again with other bytes is another key: the old one is retired.
        let impostor = Signer::generate("k2");
        let pi = impostor.public_key();
        keys.offer_revoking("a", [("k2", &pi[..])], ["k1"]);
        assert!(!by_k2.withdrawn.is_cancelled());
        assert!(matches!(
            keys.verify(&token(&k2)),
            Err(TokenError::Invalid(_))
        ));
        // An empty offer empties the instance's set; the operator's keys stay.
        keys.offer_revoking("a", [], []);
        keys.offer_revoking("b", [], []);
        assert!(keys.verify(&token(&impostor)).is_err());
        assert!(keys.verify(&token(&configured)).is_ok());
        assert_eq!(keys.len(), 1);
        // Revoking the retired k2 ends what it admitted.
        keys.offer_revoking("a", [], ["k2"]);
        assert!(by_k2.withdrawn.is_cancelled());
    }

    #[test]
    fn keys_are_bound_to_their_instance() {
        let real = Signer::generate("k1");
        let forger = Signer::generate("k1");
        let other_kid = Signer::generate("evil");
        let (pr, pf, po) = (
            real.public_key(),
            forger.public_key(),
            other_kid.public_key(),
        );
        let keys = Keys::default();
        let operator = Signer::generate("op");
        keys.insert("op", operator.public_key());
        keys.offer_revoking("real", [("k1", &pr[..])], []);
        let sign = |s: &Signer, iss: Option<&str>| {
            let c = claims(Duration::from_secs(60));
            s.sign(&match iss {
                Some(iss) => c.issued_by(iss),
                None => c,
            })
        };
        let admitted = keys.admit(&sign(&real, Some("real"))).unwrap();
        assert_eq!(admitted.instance.as_deref(), Some("real"));
        // A stranger's handshake under another instance id, with its own key under the real
        // kid or another, and a revocation of the real kid.
        keys.offer_revoking("forged", [("k1", &pf[..]), ("evil", &po[..])], ["k1", "op"]);
        for token in [sign(&forger, Some("real")), sign(&other_kid, Some("real"))] {
            assert!(
                matches!(keys.verify(&token), Err(TokenError::Invalid(_))),
                "a forged key signed for the real instance"
            );
        }
        // Its own tokens say whose they are (the entrypoint admits them only to its lessons).
        let forged = keys.admit(&sign(&other_kid, None)).unwrap();
        assert_eq!(forged.instance.as_deref(), Some("forged"));
        // Its revocation touched neither the real instance's key nor the operator's.
        assert!(!admitted.withdrawn.is_cancelled());
        assert!(keys.verify(&sign(&real, Some("real"))).is_ok());
        assert!(keys.verify(&sign(&real, None)).is_ok());
        let by_operator = keys.admit(&sign(&operator, Some("real"))).unwrap();
        assert_eq!(by_operator.instance, None);
        // The real instance's own revocation does end what its key admitted.
        keys.offer_revoking("real", [], ["k1"]);
        assert!(admitted.withdrawn.is_cancelled());
        assert!(keys.verify(&sign(&real, Some("real"))).is_err());
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
