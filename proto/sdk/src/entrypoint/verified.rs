//! Tokens the entrypoint verified lately, kept behind one small function ([`Verified::admit`])
//! so that the requests of a page do not each verify an Ed25519 signature.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use super::token::{self, Admitted, Keys, TokenError};

/// How many verified tokens [`Verified`] keeps.
const VERIFIED_MAX: usize = 4096;
/// How long a verified token is admitted without verifying it again.
const VERIFIED_FOR: Duration = Duration::from_secs(30);

/// Tokens verified lately, so that a page's requests do not each verify a signature: by the
/// token's text, what [`Keys::admit`] answered, kept at most [`VERIFIED_FOR`] and never past
/// the token's expiry, the withdrawal of its key, or any change of the key set (its
/// [`Keys::generation`]). At most [`VERIFIED_MAX`] tokens; refusals are not kept.
#[derive(Debug, Default)]
pub(super) struct Verified {
    seen: Mutex<HashMap<String, (Admitted, u64, Instant)>>,
}

impl Verified {
    /// [`Keys::admit`], answered from the tokens verified lately when it can be.
    pub(super) fn admit(&self, keys: &Keys, token: &str) -> Result<Admitted, TokenError> {
        let generation = keys.generation();
        let now = Instant::now();
        let unix_now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((admitted, at_generation, at)) = seen.get(token) {
                if *at_generation == generation
                    && now.duration_since(*at) < VERIFIED_FOR
                    && !admitted.withdrawn.is_cancelled()
                    && admitted.claims.exp + token::LEEWAY.as_secs() >= unix_now
                {
                    return Ok(admitted.clone());
                }
                seen.remove(token);
            }
        }
        let admitted = keys.admit(token)?;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= VERIFIED_MAX {
            seen.retain(|_, (admitted, at_generation, at)| {
                *at_generation == generation
                    && now.duration_since(*at) < VERIFIED_FOR
                    && !admitted.withdrawn.is_cancelled()
            });
            if seen.len() >= VERIFIED_MAX {
                seen.clear();
            }
        }
        seen.insert(token.to_owned(), (admitted.clone(), generation, now));
        Ok(admitted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entrypoint::{Claims, Signer};
    use tokio_util::sync::CancellationToken;

    #[test]
    fn verified_tokens_are_kept_only_while_their_key_set_stands() {
        let claims = |ttl| Claims::new("ll", "ep", "pr", Duration::from_secs(ttl));
        let (k1, op) = (Signer::generate("k1"), Signer::generate("op"));
        let keys = Keys::default();
        keys.insert("op", op.public_key());
        let p1 = k1.public_key();
        keys.offer("a", [("k1", &p1[..])]);
        let verified = Verified::default();
        let by_k1 = k1.sign(&claims(3600));
        let by_op = op.sign(&claims(3600));
        let first = verified.admit(&keys, &by_k1).unwrap();
        assert_eq!(verified.admit(&keys, &by_k1).unwrap().claims, first.claims);
        verified.admit(&keys, &by_op).unwrap();
        assert_eq!(verified.seen.lock().unwrap().len(), 2);
        // k1 leaves the key set: its cached token is refused at once (whether or not what it
        // admitted is told to end), the other key's stays.
        keys.offer("a", []);
        assert_eq!(
            verified.admit(&keys, &by_k1).unwrap_err(),
            TokenError::UnknownKey("k1".into())
        );
        verified.admit(&keys, &by_op).unwrap();
        // The operator's key replaced by other bytes under the same id: refused although cached.
        let other = Signer::generate("op");
        keys.insert("op", other.public_key());
        assert!(matches!(
            verified.admit(&keys, &by_op),
            Err(TokenError::Invalid(_))
        ));
        assert!(verified.admit(&keys, &other.sign(&claims(3600))).is_ok());
        // A cached token past its expiry (and the leeway) is refused.
        let mut old = claims(3600);
        old.exp = old.iat - 60;
        let expired = other.sign(&old);
        let admitted = Admitted {
            claims: old,
            withdrawn: CancellationToken::new(),
            instance: None,
        };
        verified.seen.lock().unwrap().insert(
            expired.clone(),
            (admitted, keys.generation(), Instant::now()),
        );
        assert_eq!(
            verified.admit(&keys, &expired).unwrap_err(),
            TokenError::Expired
        );
        assert!(!verified.seen.lock().unwrap().contains_key(&expired));
    }
}
