//! References generated from the `.proto` files, through the descriptor set the servers serve
//! for reflection (`antidote_proto::FILE_DESCRIPTOR_SET`, with the files' comments): the error
//! reasons (`docs/src/reference/errors.md`, from `errors.proto` and the agent protocol's
//! `ErrorReason`) and the public API's services (`docs/src/reference/services.md`).

use prost_reflect::{DescriptorPool, FileDescriptor};

fn pool() -> DescriptorPool {
    DescriptorPool::decode(antidote_proto::FILE_DESCRIPTOR_SET).expect("the descriptor set decodes")
}

/// The leading comment of the element at `path` in `file`, as one line.
fn comment(file: &FileDescriptor, path: &[i32]) -> String {
    file.file_descriptor_proto()
        .source_code_info
        .as_ref()
        .and_then(|info| info.location.iter().find(|l| l.path == path))
        .and_then(|l| l.leading_comments.as_deref())
        .map(|c| c.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// The error reasons page.
pub fn errors() -> String {
    let pool = pool();
    let mut out = String::from(
        "# Error reasons\n\n\
         <!-- Generated from proto/antidote/api/v1/errors.proto and \
         proto/antidote/agent/v1/agent.proto by the `docs` test (tests/docs/proto.rs); do not \
         edit: `ANTIDOTE_BLESS=1 cargo test -p antidote-tests --test docs` writes it again. -->\n\n\
         Every error carries a `google.rpc.ErrorInfo` in its status details with domain \
         `antidote.io` and one of these reasons (the JSON API puts it in the body's `reason`). \
         Decide on the code and the reason, never on the message, which is for people. Each \
         reason's comment names its gRPC code and its metadata keys.\n\n",
    );
    for (title, name) in [
        (
            "The scheduler: `antidote.api.v1.ErrorReason`",
            "antidote.api.v1.ErrorReason",
        ),
        (
            "Agents: `antidote.agent.v1.ErrorReason`",
            "antidote.agent.v1.ErrorReason",
        ),
    ] {
        let e = pool
            .get_enum_by_name(name)
            .unwrap_or_else(|| panic!("{name} is in the descriptor set"));
        out.push_str(&format!(
            "## {title}\n\n{}\n\n",
            comment(&e.parent_file(), e.path())
        ));
        out.push_str("| reason | number | meaning |\n|---|---|---|\n");
        for v in e.values() {
            out.push_str(&format!(
                "| `{}` | {} | {} |\n",
                v.name(),
                v.number(),
                cell(&comment(&v.parent_file(), v.path()))
            ));
        }
        out.push('\n');
    }
    out
}

/// The public API's services with their RPCs.
pub fn services() -> String {
    let pool = pool();
    let mut out = String::from(
        "<!-- Generated from proto/antidote/api/v1/*.proto by the `docs` test \
         (tests/docs/proto.rs); do not edit: `ANTIDOTE_BLESS=1 cargo test -p antidote-tests \
         --test docs` writes it again. -->\n\n",
    );
    let mut services: Vec<_> = pool
        .services()
        .filter(|s| s.package_name() == "antidote.api.v1")
        .collect();
    services.sort_by(|a, b| a.full_name().cmp(b.full_name()));
    for s in services {
        out.push_str(&format!(
            "### `{}`\n\n{}\n\n| RPC | request → response | what it does |\n|---|---|---|\n",
            s.full_name(),
            comment(&s.parent_file(), s.path())
        ));
        for m in s.methods() {
            let stream = if m.is_server_streaming() {
                "stream "
            } else {
                ""
            };
            out.push_str(&format!(
                "| `{}` | `{}` → {stream}`{}` | {} |\n",
                m.name(),
                m.input().name(),
                m.output().name(),
                cell(&comment(&m.parent_file(), m.path()))
            ));
        }
        out.push('\n');
    }
    out
}
