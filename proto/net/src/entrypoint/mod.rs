//! The entrypoint's contract between the scheduler, which signs, and the agents, which verify:
//! where learners reach a presentation ([`origin`]'s URL templates, [`presentation_path`]) and
//! the tokens that admit them ([`token`]). The entrypoint itself (the proxy, web terminals) is
//! the SDK's (`antidote_sdk::entrypoint`, feature `entrypoint`).

pub mod origin;
pub mod token;

pub use origin::{PLACEHOLDER, Template};
pub use token::{Admitted, Claims, Keys, Signer, TokenError};

/// The query parameter carrying a token.
pub const TOKEN_PARAM: &str = "antidote_token";
/// The path every presentation lives under: `/l/{live_lesson}/{endpoint}/{presentation}/`.
pub const PREFIX: &str = "/l/";

/// The path of a presentation (what the scheduler appends to the entrypoint's base URL).
pub fn presentation_path(live_lesson: &str, endpoint: &str, presentation: &str) -> String {
    format!("{PREFIX}{live_lesson}/{endpoint}/{presentation}/")
}
