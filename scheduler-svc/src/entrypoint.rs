//! Entrypoint tokens, the scheduler's side: the signing key set loaded from `[entrypoint]`, the
//! public keys agents get at handshake, and the per-presentation URLs learners get
//! (`antidote_net::entrypoint` verifies them on the agents).

use std::collections::BTreeMap;
use std::time::Duration;

use antidote_net::entrypoint::{
    Claims, PLACEHOLDER, Signer, TOKEN_PARAM, Template, presentation_path,
};

use crate::settings::EntrypointConfig;

/// The key set and what goes with it. Without keys, nothing is signed.
#[derive(Debug, Default)]
pub struct Tokens {
    /// Every configured key, in configuration order.
    signers: Vec<Signer>,
    /// The index of the one that signs.
    current: usize,
    /// A token's lifetime.
    ttl: Duration,
    /// Agents' entrypoint URLs from the configuration, by agent name.
    urls: BTreeMap<String, String>,
    /// `[entrypoint] backend_addresses`: learners see backend addresses where they get no
    /// entrypoint URL.
    backend_addresses: bool,
    /// `[entrypoint] revoked`: key ids agents refuse and end what they admitted.
    revoked: Vec<String>,
    /// This scheduler's instance id, named in every token (`iss`): agents verify a token only
    /// with the keys of the instance it names.
    instance_id: Option<String>,
}

impl Tokens {
    /// Reads the key files; an error names the file and why.
    pub fn load(config: &EntrypointConfig) -> Result<Tokens, String> {
        let mut signers = Vec::new();
        for key in &config.keys {
            let pem = std::fs::read(&key.file)
                .map_err(|err| format!("entrypoint key {}: {err}", key.file.display()))?;
            signers.push(
                Signer::from_pem(&key.id, &pem)
                    .map_err(|err| format!("entrypoint key {}: {err}", key.file.display()))?,
            );
        }
        let current = match &config.current {
            Some(id) => signers
                .iter()
                .position(|s| s.key_id() == id)
                .ok_or_else(|| format!("entrypoint.current `{id}` names no key"))?,
            None => signers.len().saturating_sub(1),
        };
        Ok(Tokens {
            signers,
            current,
            ttl: config.token_ttl,
            urls: config
                .urls
                .iter()
                .map(|(k, v)| (k.clone(), v.trim_end_matches('/').to_owned()))
                .collect(),
            backend_addresses: config.backend_addresses,
            revoked: config.revoked.clone(),
            instance_id: None,
        })
    }

    /// The key set, its tokens naming scheduler instance `instance_id` as their issuer.
    pub fn issued_by(mut self, instance_id: &str) -> Tokens {
        self.instance_id = Some(instance_id.to_owned());
        self
    }

    /// The revoked key ids, for handshakes.
    pub fn revoked(&self) -> &[String] {
        &self.revoked
    }

    /// Whether learners see backend addresses where they get no entrypoint URL
    /// (`[entrypoint] backend_addresses`).
    pub fn backend_addresses(&self) -> bool {
        self.backend_addresses
    }

    /// Whether tokens are signed at all.
    pub fn enabled(&self) -> bool {
        !self.signers.is_empty()
    }

    /// Every key's id and public half, for handshakes.
    pub fn public_keys(&self) -> Vec<(String, Vec<u8>)> {
        self.signers
            .iter()
            .map(|s| (s.key_id().to_owned(), s.public_key().to_vec()))
            .collect()
    }

    /// The configured entrypoint URL of an agent, if any.
    pub fn configured_url(&self, agent: &str) -> Option<&str> {
        self.urls.get(agent).map(String::as_str)
    }

    /// A presentation's URL at the entrypoint URL `base` (the live lesson's own origin when
    /// `base` holds [`PLACEHOLDER`]), with a fresh token; `None` without keys.
    pub fn url(
        &self,
        base: &str,
        live_lesson: &str,
        endpoint: &str,
        presentation: &str,
        ssh: bool,
    ) -> Option<String> {
        let signer = self.signers.get(self.current)?;
        let mut claims = Claims::new(live_lesson, endpoint, presentation, self.ttl);
        claims.iss = self.instance_id.clone();
        let token = signer.sign(&claims);
        let path = presentation_path(live_lesson, endpoint, presentation);
        let terminal = if ssh { "terminal" } else { "" };
        Some(format!(
            "{}{path}{terminal}?{TOKEN_PARAM}={token}",
            base.trim_end_matches('/').replace(PLACEHOLDER, live_lesson)
        ))
    }
}

/// The Content-Security-Policy source matching every live lesson's origin of an entrypoint URL
/// with an origin per lesson (`https://*.lab.example`), for the learner page; `None` for any
/// other URL (one origin for all, or not a valid URL: an agent's handshake is not checked).
pub fn per_lesson_source(url: &str) -> Option<String> {
    Template::parse(url)
        .ok()
        .filter(Template::per_lesson)
        .map(|t| t.policy_source())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::EntrypointKeyConfig;
    use antidote_net::entrypoint::Keys;

    #[test]
    fn rotation_keeps_old_keys_verifying() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, seed: u8| {
            let path = dir.path().join(name);
            // PKCS#8 v1 of an Ed25519 seed, as `openssl genpkey` writes it.
            let mut der = vec![
                0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
                0x04, 0x20,
            ];
            der.extend([seed; 32]);
            let pem = rustls_pem("PRIVATE KEY", &der);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let mut config = EntrypointConfig {
            keys: vec![EntrypointKeyConfig {
                id: "k1".into(),
                file: write("k1.pem", 1),
            }],
            ..Default::default()
        };
        let old = Tokens::load(&config).unwrap();
        let url = old.url("https://e:1/", "ll", "ep", "pr", true).unwrap();
        assert!(url.starts_with("https://e:1/l/ll/ep/pr/terminal?antidote_token="));
        config.keys.push(EntrypointKeyConfig {
            id: "k2".into(),
            file: write("k2.pem", 2),
        });
        let new = Tokens::load(&config).unwrap();
        // What an agent does with the handshake's keys.
        let keys = Keys::default();
        let offered = new.public_keys();
        keys.offer(
            "antidote",
            offered
                .iter()
                .map(|(id, public)| (id.as_str(), public.as_slice())),
        );
        assert_eq!(keys.len(), 2);
        let token = |url: &str| url.split_once("antidote_token=").unwrap().1.to_owned();
        assert!(
            keys.verify(&token(&url)).is_ok(),
            "a k1 token still verifies"
        );
        let fresh = new.url("https://e:1", "ll", "ep", "pr", false).unwrap();
        assert!(fresh.starts_with("https://e:1/l/ll/ep/pr/?"));
        // An origin per live lesson: the id is the host's first label.
        let own = new
            .url(
                "http://{live_lesson}.localhost:7074/",
                "ll",
                "ep",
                "pr",
                false,
            )
            .unwrap();
        assert!(
            own.starts_with("http://ll.localhost:7074/l/ll/ep/pr/?"),
            "{own}"
        );
        assert_eq!(
            per_lesson_source("http://{live_lesson}.localhost:7074").as_deref(),
            Some("http://*.localhost:7074")
        );
        assert_eq!(per_lesson_source("https://lab.example"), None);
        assert_eq!(per_lesson_source("http://{live_lesson}.x;script-src"), None);
        assert!(keys.verify(&token(&fresh)).is_ok());
        config.current = Some("nope".into());
        assert!(Tokens::load(&config).is_err());
        assert!(!Tokens::default().enabled());
    }

    fn rustls_pem(label: &str, der: &[u8]) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in der.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        format!("-----BEGIN {label}-----\n{out}\n-----END {label}-----\n")
    }
}
