//! Who may call (DESIGN.md §7). Learners hold a session token: a secret answered once by
//! CreateSession, kept only as its SHA-256, sent as `authorization: Bearer TOKEN` (or the
//! `antidote_session` cookie on the JSON API). Operators call the admin API, on its own
//! listener, with static bearer tokens configured by their SHA-256 and scopes.
//!
//! Tokens are 256 random bits from the OS, so a single SHA-256 suffices to store them (there is
//! nothing to brute-force, unlike a password): no slow hash on every call.

use std::collections::HashMap;

use sha2::{Digest as _, Sha256};
use tonic::metadata::MetadataMap;

use crate::error::Error;
use crate::settings::{AdminConfig, Scope};

/// The prefix of learners' session tokens, so a leaked one is recognisable in logs and scanners.
const SESSION_TOKEN_PREFIX: &str = "ast_";

/// The cookie the JSON API sets at CreateSession and reads when no `authorization` header
/// comes (browsers' EventSource cannot send headers).
pub const SESSION_COOKIE: &str = "antidote_session";

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

/// The admin API's tokens: their hashes, with a name (the identity audited) and scopes.
#[derive(Debug, Default)]
pub struct AdminAuth {
    tokens: HashMap<[u8; 32], (String, Vec<Scope>)>,
}

impl AdminAuth {
    /// The configured tokens (validated by the settings: 64 hex digits each).
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
        AdminAuth { tokens }
    }

    /// Who the caller is, if its token allows `scope`: UNAUTHENTICATED without a known token,
    /// PERMISSION_DENIED without the scope. The identity is `token:NAME`.
    pub fn check(&self, metadata: &MetadataMap, scope: Scope) -> Result<String, (String, Error)> {
        let anonymous = || "anonymous".to_owned();
        let Some(token) = bearer(metadata) else {
            return Err((
                anonymous(),
                Error::Unauthenticated("the admin API needs `authorization: Bearer TOKEN`".into()),
            ));
        };
        let Some((name, scopes)) = self.tokens.get(&hash(token)) else {
            return Err((
                anonymous(),
                Error::Unauthenticated("the bearer token is not one this scheduler knows".into()),
            ));
        };
        let identity = format!("token:{name}");
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

#[cfg(test)]
mod tests {
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
        assert_eq!(check(Some("Bearer nope"), Scope::Read), "anonymous: Unauthenticated");
        assert_eq!(check(Some("Basic read-secret"), Scope::Read), "anonymous: Unauthenticated");
        assert_eq!(check(Some("Bearer read-secret"), Scope::Read), "token:viewer");
        assert_eq!(check(Some("bearer read-secret"), Scope::Read), "token:viewer");
        assert_eq!(
            check(Some("Bearer read-secret"), Scope::Write),
            "token:viewer: PermissionDenied"
        );
        assert_eq!(check(Some("Bearer write-secret"), Scope::Write), "token:ops");
        assert_eq!(check(Some("Bearer write-secret"), Scope::Read), "token:ops");
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
