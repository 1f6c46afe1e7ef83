//! Where learners reach the entrypoint: its URL, with an origin of its own per live lesson or
//! one origin for all.
//!
//! A URL holding [`PLACEHOLDER`] as its host's first label (`https://{live_lesson}.lab.example`)
//! gives every live lesson its own origin, `https://<live-lesson-id>.lab.example`: a page of one
//! learner's lesson is cross-origin to every other lesson, so the browser keeps their scripts,
//! cookies and storage apart. It needs a wildcard DNS name (names under `localhost` resolve to
//! loopback without one) and, for `https`, a wildcard certificate. A URL without the
//! placeholder serves every live lesson from one origin (the path mode): weaker, and hardened
//! by the entrypoint instead (a sandboxing policy on proxied pages, WebSocket `Origin` checks).

/// The live lesson id's place in an entrypoint URL.
pub const PLACEHOLDER: &str = "{live_lesson}";

/// An entrypoint URL (`--entrypoint-url`, the scheduler's `[entrypoint] urls`), checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// The URL as given, without a trailing slash.
    url: String,
    /// `Some`: an origin per live lesson.
    per_lesson: Option<PerLesson>,
}

/// The parts of a per-lesson URL around the placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PerLesson {
    /// `http` or `https`, lower case.
    scheme: String,
    /// The host after `{live_lesson}.`, lower case (`lab.example`).
    domain: String,
    /// `:PORT`, or empty.
    port: String,
}

impl Template {
    /// Checks `url`: `http(s)://host[:port]` with nothing after but `/`; the placeholder, when
    /// there, is the host's whole first label, once. Per-lesson origins over plain `http` only
    /// under `localhost` (browsers keep `Secure` cookies only on secure origins, and the
    /// entrypoint's cookie then is one). The error says what is wrong with the URL.
    pub fn parse(url: &str) -> Result<Template, String> {
        let url = url.trim().trim_end_matches('/');
        let (scheme, authority) = url
            .split_once("://")
            .ok_or_else(|| format!("entrypoint URL `{url}` is not http(s)://HOST[:PORT]"))?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(format!(
                "entrypoint URL `{url}`: the scheme must be http or https"
            ));
        }
        if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
            return Err(format!(
                "entrypoint URL `{url}`: give scheme://HOST[:PORT] only (presentations live under /l/)"
            ));
        }
        let count = authority.matches(PLACEHOLDER).count();
        if count == 0 {
            return Ok(Template {
                url: url.to_owned(),
                per_lesson: None,
            });
        }
        let rest = authority
            .strip_prefix(PLACEHOLDER)
            .and_then(|rest| rest.strip_prefix('.'))
            .filter(|_| count == 1)
            .ok_or_else(|| {
                format!(
                    "entrypoint URL `{url}`: {PLACEHOLDER} must be the host's first label, once \
                     (like https://{PLACEHOLDER}.lab.example)"
                )
            })?;
        let (domain, port) = match rest.rsplit_once(':') {
            Some((domain, port)) => {
                port.parse::<std::num::NonZeroU16>()
                    .map_err(|_| format!("entrypoint URL `{url}`: `{port}` is not a port"))?;
                (domain, format!(":{port}"))
            }
            None => (rest, String::new()),
        };
        let label_ok = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if !domain.split('.').all(label_ok) {
            return Err(format!(
                "entrypoint URL `{url}`: `{domain}` is not a DNS name (a wildcard name \
                 *.{domain} must lead to the entrypoint)"
            ));
        }
        let domain = domain.to_ascii_lowercase();
        if scheme == "http" && domain != "localhost" && !domain.ends_with(".localhost") {
            return Err(format!(
                "entrypoint URL `{url}`: an origin per live lesson needs https (a wildcard \
                 certificate for *.{domain}), or names under localhost"
            ));
        }
        Ok(Template {
            url: url.to_owned(),
            per_lesson: Some(PerLesson {
                scheme,
                domain,
                port,
            }),
        })
    }

    /// The URL as given (what an agent reports), without a trailing slash.
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// Whether each live lesson has an origin of its own.
    pub fn per_lesson(&self) -> bool {
        self.per_lesson.is_some()
    }

    /// Whether the URL's scheme is https.
    pub fn https(&self) -> bool {
        self.url
            .get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
    }

    /// The base URL of `live_lesson`'s presentations (no trailing slash).
    pub fn base(&self, live_lesson: &str) -> String {
        self.url.replace(PLACEHOLDER, live_lesson)
    }

    /// The origin of `live_lesson`'s presentations (`scheme://host[:port]`, lower case).
    pub fn origin(&self, live_lesson: &str) -> String {
        match &self.per_lesson {
            Some(p) => format!(
                "{}://{}.{}{}",
                p.scheme,
                live_lesson.to_ascii_lowercase(),
                p.domain,
                p.port
            ),
            None => self.url.to_ascii_lowercase(),
        }
    }

    /// A Content-Security-Policy source matching every live lesson's origin
    /// (`https://*.lab.example:8443`), for the learner page's `frame-src` and `connect-src`.
    pub fn policy_source(&self) -> String {
        match &self.per_lesson {
            Some(p) => format!("{}://*.{}{}", p.scheme, p.domain, p.port),
            None => self.url.to_ascii_lowercase(),
        }
    }

    /// The live lesson a request's `Host` names (its first label; the port is not compared,
    /// a proxy in front may change it), or `None` when the host is not under the URL's domain
    /// (or this is no per-lesson URL).
    pub fn lesson_of_host<'h>(&self, host: &'h str) -> Option<&'h str> {
        let p = self.per_lesson.as_ref()?;
        let name = match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        };
        let name = name.trim_end_matches('.');
        let (label, domain) = name.split_once('.')?;
        (!label.is_empty() && domain.eq_ignore_ascii_case(&p.domain)).then_some(label)
    }
}

/// An `Origin` (a learner page's, `--entrypoint-learner-origin`): `http(s)://host[:port]`,
/// lower case, without a path; the error names what is wrong.
pub fn parse_origin(text: &str) -> Result<String, String> {
    let text = text.trim().trim_end_matches('/');
    let (scheme, authority) = text
        .split_once("://")
        .ok_or_else(|| format!("`{text}` is not an origin (http(s)://HOST[:PORT])"))?;
    let scheme = scheme.to_ascii_lowercase();
    let fine = (scheme == "http" || scheme == "https")
        && !authority.is_empty()
        && authority
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !fine {
        return Err(format!(
            "`{text}` is not an origin (http(s)://HOST[:PORT], no path)"
        ));
    }
    Ok(format!("{scheme}://{}", authority.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        let path = Template::parse("https://lab.example:8443/").unwrap();
        assert!(!path.per_lesson());
        assert_eq!(path.base("L1"), "https://lab.example:8443");
        assert_eq!(path.origin("L1"), "https://lab.example:8443");
        assert_eq!(path.lesson_of_host("lab.example:8443"), None);

        let each = Template::parse("http://{live_lesson}.localhost:7074/").unwrap();
        assert!(each.per_lesson());
        assert_eq!(each.as_str(), "http://{live_lesson}.localhost:7074");
        assert_eq!(each.base("abc"), "http://abc.localhost:7074");
        assert_eq!(each.origin("abc"), "http://abc.localhost:7074");
        assert_eq!(each.policy_source(), "http://*.localhost:7074");
        assert_eq!(each.lesson_of_host("abc.localhost:7074"), Some("abc"));
        assert_eq!(each.lesson_of_host("abc.LOCALHOST"), Some("abc"));
        assert_eq!(each.lesson_of_host("localhost:7074"), None);
        assert_eq!(each.lesson_of_host("abc.evil.example:7074"), None);
        assert_eq!(each.lesson_of_host("a.b.localhost:7074"), None);

        let tls = Template::parse("https://{live_lesson}.lab.example").unwrap();
        assert_eq!(tls.lesson_of_host("x-1.lab.example"), Some("x-1"));
        assert!(tls.https());

        for (bad, says) in [
            ("lab.example", "not http(s)"),
            ("ftp://lab.example", "scheme"),
            ("https://lab.example/base", "HOST[:PORT] only"),
            ("https://lab-{live_lesson}.example", "first label"),
            ("https://{live_lesson}.{live_lesson}.example", "first label"),
            ("https://{live_lesson}.lab.example:http", "not a port"),
            ("https://{live_lesson}.lab_example", "not a DNS name"),
            ("http://{live_lesson}.lab.example", "needs https"),
        ] {
            let err = Template::parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn origins() {
        assert_eq!(
            parse_origin("HTTPS://Learn.Example:8443/").unwrap(),
            "https://learn.example:8443"
        );
        for bad in [
            "learn.example",
            "https://learn.example/learn/",
            "ws://x",
            "https://",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad}");
        }
    }
}
