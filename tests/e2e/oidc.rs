//! Operators' single sign-on: the admin API also takes an OIDC JWT, verified
//! against the JWKS file of `admin.oidc` (key by `kid`, issuer, audience, expiry, then the scope
//! claim), and picks up a rotated key set without a restart. The keys are made here with
//! Debian's `openssl` (RSA and Ed25519), which also signs the tokens, so this checks the
//! scheduler against an independent JWT implementation.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use antidote_proto::api::v1 as api;
use antidote_tests::command::output_with_input_blocking;
use antidote_tests::web::Web;
use antidote_tests::{ADMIN_READ_TOKEN, with_token};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tonic::Code;
use tonic_types::StatusExt as _;

use crate::{Env, Knobs, PATIENCE};

const ISSUER: &str = "https://sso.example.test/realms/ops";
const AUDIENCE: &str = "antidote-admin";

/// Runs `openssl` with `args`, feeding it `input`; its standard output.
fn openssl(args: &[&str], input: &[u8]) -> Vec<u8> {
    let mut command = Command::new("openssl");
    command.args(args);
    let output = output_with_input_blocking(command, input)
        .expect("openssl runs (Debian package `openssl`)");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}

/// Base64url without padding, as JWTs and JWKs use.
fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// A signing key of the test's identity provider.
struct Key {
    /// Its `kid`.
    kid: String,
    /// `RS256` or `EdDSA`.
    alg: &'static str,
    /// The private key (PEM).
    pem: PathBuf,
    /// Its public half as a JWKS entry.
    jwk: Value,
}

impl Key {
    fn rsa(dir: &Path, kid: &str) -> Key {
        let pem = dir.join(format!("{kid}.pem"));
        let path = pem.to_str().expect("a UTF-8 temp path");
        openssl(
            &[
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
                path,
            ],
            b"",
        );
        let modulus = String::from_utf8(openssl(&["rsa", "-in", path, "-noout", "-modulus"], b""))
            .expect("text");
        let modulus = hex::decode(modulus.trim().trim_start_matches("Modulus=")).expect("hex");
        Key {
            kid: kid.into(),
            alg: "RS256",
            pem,
            // openssl's default public exponent, 65537. No `alg`: the scheduler allows the RSA
            // signature algorithms for an RSA key that names none.
            jwk: json!({"kty": "RSA", "use": "sig", "kid": kid, "n": b64url(&modulus), "e": "AQAB"}),
        }
    }

    fn ed25519(dir: &Path, kid: &str) -> Key {
        let pem = dir.join(format!("{kid}.pem"));
        let path = pem.to_str().expect("a UTF-8 temp path");
        openssl(&["genpkey", "-algorithm", "ED25519", "-out", path], b"");
        // The DER SubjectPublicKeyInfo ends with the 32 bytes of the public key.
        let der = openssl(&["pkey", "-in", path, "-pubout", "-outform", "DER"], b"");
        let x = &der[der.len() - 32..];
        Key {
            kid: kid.into(),
            alg: "EdDSA",
            pem,
            jwk: json!({"kty": "OKP", "crv": "Ed25519", "use": "sig", "alg": "EdDSA", "kid": kid, "x": b64url(x)}),
        }
    }

    /// A JWT of `claims` signed by this key and naming it.
    fn sign(&self, claims: &Value) -> String {
        self.sign_as(
            &json!({"alg": self.alg, "typ": "JWT", "kid": self.kid}),
            claims,
        )
    }

    /// A JWT with this `header`, signed by this key whatever the header says.
    fn sign_as(&self, header: &Value, claims: &Value) -> String {
        let message = format!(
            "{}.{}",
            b64url(header.to_string().as_bytes()),
            b64url(claims.to_string().as_bytes())
        );
        let pem = self.pem.to_str().expect("a UTF-8 temp path");
        let signature = match self.alg {
            "RS256" => openssl(&["dgst", "-sha256", "-sign", pem], message.as_bytes()),
            _ => {
                let input = self.pem.with_extension("msg");
                std::fs::write(&input, &message).expect("message written");
                let input = input.to_str().expect("a UTF-8 temp path");
                openssl(
                    &["pkeyutl", "-sign", "-inkey", pem, "-rawin", "-in", input],
                    b"",
                )
            }
        };
        format!("{message}.{}", b64url(&signature))
    }
}

/// Replaces the JWKS file with `keys` at once (a new file renamed over the old one, as an
/// operator's tooling or a Kubernetes volume does), so the scheduler never reads half a file.
fn write_jwks(path: &Path, keys: &[&Key]) {
    let keys: Vec<&Value> = keys.iter().map(|key| &key.jwk).collect();
    let next = path.with_extension("next");
    std::fs::write(&next, json!({ "keys": keys }).to_string()).expect("JWKS written");
    std::fs::rename(&next, path).expect("JWKS replaced");
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs() as i64
}

/// Claims our provider would issue to `sub` with `scope`, then `changes` applied.
fn claims(sub: &str, scope: &str, changes: Value) -> Value {
    let now = unix_now();
    let mut claims = json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": sub, "scope": scope,
        "iat": now, "nbf": now, "exp": now + 600,
    });
    for (key, value) in changes.as_object().expect("an object") {
        claims[key] = value.clone();
    }
    claims
}

/// The scheduler with `[admin.oidc]` trusting the keys in `jwks`.
fn knobs(jwks: &Path) -> Knobs {
    Knobs {
        config: Env::config().with_oidc(ISSUER, AUDIENCE, jwks),
        ..Knobs::default()
    }
}

/// A kill of `id` carrying `token`.
fn kill(id: &str, token: &str) -> tonic::Request<api::KillLiveLessonRequest> {
    with_token(
        api::KillLiveLessonRequest { id: id.into() },
        Some(token.into()),
    )
}

#[tokio::test]
async fn an_sso_jwt_with_the_write_scope_kills_and_every_bad_one_is_unauthenticated() {
    let keys = tempfile::tempdir().expect("temp dir");
    let (rsa, ed) = (
        Key::rsa(keys.path(), "rsa-1"),
        Key::ed25519(keys.path(), "ed-1"),
    );
    let stranger = Key::rsa(keys.path(), "rsa-x");
    let jwks = keys.path().join("jwks.json");
    write_jwks(&jwks, &[&rsa, &ed]);
    let env = Env::start(&[], knobs(&jwks)).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id).await.unwrap();
    let mut admin = api::admin_service_client::AdminServiceClient::new(c.admin_channel.clone());

    let now = unix_now();
    let write = "openid admin:write";
    let valid = claims("alice", write, json!({}));
    // Signed by a key not in the JWKS but claiming the name of one that is.
    let impostor = Key {
        kid: "rsa-1".into(),
        ..Key::rsa(keys.path(), "rsa-y")
    };
    let unsigned = format!(
        "{}.{}.",
        b64url(br#"{"alg":"none","typ":"JWT","kid":"rsa-1"}"#),
        b64url(valid.to_string().as_bytes())
    );
    let refused = [
        (
            "expired",
            ed.sign(&claims("alice", write, json!({"exp": now - 600}))),
            "expired",
        ),
        (
            "wrong audience",
            rsa.sign(&claims("alice", write, json!({"aud": "grafana"}))),
            "audience",
        ),
        (
            "wrong issuer",
            rsa.sign(&claims(
                "alice",
                write,
                json!({"iss": "https://evil.example"}),
            )),
            "issuer",
        ),
        (
            "unknown kid",
            stranger.sign(&valid),
            "`rsa-x` is not in the JWKS",
        ),
        ("signed by another key", impostor.sign(&valid), "signature"),
        ("alg none", unsigned, "algorithm never accepted"),
        (
            "the RSA key as an HMAC secret",
            {
                let header = json!({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"});
                let message = format!(
                    "{}.{}",
                    b64url(header.to_string().as_bytes()),
                    b64url(valid.to_string().as_bytes())
                );
                let secret = rsa.jwk["n"].as_str().expect("n");
                let mac = openssl(
                    &["dgst", "-sha256", "-hmac", secret, "-binary"],
                    message.as_bytes(),
                );
                format!("{message}.{}", b64url(&mac))
            },
            "HS256",
        ),
    ];
    for (what, token, says) in &refused {
        let status = admin
            .kill_live_lesson(kill(&lesson.id, token))
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
        let reason = status.get_details_error_info().map(|info| info.reason);
        assert_eq!(reason.as_deref(), Some("UNAUTHENTICATED"), "{what}");
        assert!(
            status.message().contains(says),
            "{what}: `{}` does not say `{says}`",
            status.message()
        );
        assert!(!status.message().contains(token.as_str()), "{what}: echoed");
    }

    // The read scope may look but not kill; the lesson is still READY.
    let viewer = ed.sign(&claims("bob", "openid admin:read", json!({})));
    let status = admin
        .kill_live_lesson(kill(&lesson.id, &viewer))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let listed = admin
        .list_live_lessons(with_token(
            api::AdminListLiveLessonsRequest::default(),
            Some(viewer.clone()),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.live_lessons[0].status(),
        api::LiveLessonStatus::Ready
    );

    // The JSON admin API takes the same tokens.
    let admin_http = env.scheduler.process.extra_url("admin http").unwrap();
    let web = Web::default();
    for (token, expected) in [
        (&viewer, StatusCode::OK),
        (&refused[0].1, StatusCode::UNAUTHORIZED),
    ] {
        let answer = web
            .send(
                Method::GET,
                &format!("{admin_http}/v1/admin/sessions"),
                &[("authorization", &format!("Bearer {token}"))],
                None,
            )
            .await
            .unwrap();
        assert_eq!(answer.status, expected, "{}", answer.body);
    }

    // A valid token of either key with the write scope kills.
    let operator = rsa.sign(&valid);
    admin
        .kill_live_lesson(kill(&lesson.id, &operator))
        .await
        .unwrap();
    c.gone(&lesson.id, PATIENCE).await.unwrap();

    // Audited as `oidc:SUBJECT`, never with a token; static tokens still work beside OIDC.
    let audit = admin
        .list_audit(with_token(
            api::ListAuditRequest { limit: 20 },
            Some(ADMIN_READ_TOKEN.into()),
        ))
        .await
        .unwrap()
        .into_inner()
        .entries;
    let lines: Vec<String> = audit
        .iter()
        .map(|e| format!("{} {} {} {}", e.identity, e.action, e.target, e.outcome))
        .collect();
    let id = &lesson.id;
    for expected in [
        format!("anonymous AdminService.KillLiveLesson {id} UNAUTHENTICATED"),
        format!("oidc:bob AdminService.KillLiveLesson {id} PERMISSION_DENIED"),
        "oidc:bob AdminService.ListLiveLessons  ok".to_owned(),
        format!("oidc:alice AdminService.KillLiveLesson {id} ok"),
    ] {
        assert!(lines.contains(&expected), "no `{expected}` in {lines:#?}");
    }
    let (text, logs) = (format!("{audit:?}"), env.logs());
    for token in refused
        .iter()
        .map(|(_, token, _)| token)
        .chain([&viewer, &operator])
    {
        // A token's signature alone would be a replayable secret.
        let signature = token.rsplit('.').next().unwrap_or_default();
        for (place, haystack) in [("audit log", &text), ("scheduler's log", &logs)] {
            assert!(
                signature.is_empty() || !haystack.contains(signature),
                "the {place} holds a token"
            );
        }
    }
}

#[tokio::test]
async fn a_rotated_jwks_is_used_without_a_restart() {
    let keys = tempfile::tempdir().expect("temp dir");
    let (old, new) = (
        Key::ed25519(keys.path(), "ed-2024"),
        Key::rsa(keys.path(), "rsa-2025"),
    );
    let jwks = keys.path().join("jwks.json");
    write_jwks(&jwks, &[&old]);
    let env = Env::start(&[], knobs(&jwks)).await;
    let mut admin = api::admin_service_client::AdminServiceClient::new(
        env.scheduler.clients.admin_channel.clone(),
    );
    let list = |token: &str| with_token(api::ListSessionsRequest {}, Some(token.to_owned()));
    let (old_token, new_token) = (
        old.sign(&claims("alice", "admin:read", json!({}))),
        new.sign(&claims("alice", "admin:read", json!({}))),
    );
    admin.list_sessions(list(&old_token)).await.unwrap();
    let status = admin.list_sessions(list(&new_token)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "not yet: {status:?}");

    // The provider rotates: the file now holds only the new key. The scheduler reads it again
    // for a key it does not know (at most once a second, and the refusal above just did) or when
    // its modification time changed (looked at every few seconds): within seconds either way.
    write_jwks(&jwks, &[&new]);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match admin.list_sessions(list(&new_token)).await {
            Ok(_) => break,
            Err(status) if Instant::now() < deadline => {
                assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(status) => panic!("the rotated key is not used: {status:?}\n{}", env.logs()),
        }
    }
    let status = admin.list_sessions(list(&old_token)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "retired: {status:?}");
    assert!(
        status.message().contains("`ed-2024` is not in the JWKS"),
        "{status:?}"
    );
}
