//! Embeds the learner page's library assets (xterm.js, marked, DOMPurify; see
//! `scheduler-svc/web/build`, which copies them from npm into `$ANTIDOTE_WEB_DIR`, default
//! `target/web`) as a table of `include_bytes!`. Without them the table is empty and the page
//! says which command builds them: a plain `cargo build` always works.

use std::path::{Path, PathBuf};

/// The files `web/src/index.html` loads from `vendor/`; anything else in the directory is
/// ignored, so a stray file never ends up in the binary.
const VENDOR: &[&str] = &[
    "xterm.js",
    "xterm.css",
    "addon-fit.js",
    "marked.js",
    "purify.js",
    // Their licences, served beside them (xterm.js's build carries no notice of its own).
    "LICENSE.xterm",
    "LICENSE.addon-fit",
    "LICENSE.marked",
    "LICENSE.dompurify",
    "LICENSE-MPL.dompurify",
];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-env-changed=ANTIDOTE_WEB_DIR");
    let dir = match std::env::var_os("ANTIDOTE_WEB_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => manifest.join("../target/web"),
    };
    // Cargo reruns a build script on every build while a path it watches is missing (and then
    // rebuilds the crate), so the directory is made empty when absent and watched as such.
    let _ = std::fs::create_dir_all(&dir);
    println!("cargo:rerun-if-changed={}", dir.display());
    let vendor = dir.join("vendor");
    let mut table = String::from("/// The learner page's library files: name, bytes.\n");
    table.push_str("pub static VENDOR: &[(&str, &[u8])] = &[\n");
    let mut complete = true;
    for name in VENDOR {
        let path = vendor.join(name);
        if is_file(&path) {
            let path = path
                .canonicalize()
                .expect("an existing file has a canonical path");
            table.push_str(&format!(
                "    ({name:?}, include_bytes!({:?})),\n",
                path.display().to_string()
            ));
        } else {
            complete = false;
        }
    }
    table.push_str("];\n");
    table.push_str(&format!(
        "/// Whether every library file was there at build time.\npub const COMPLETE: bool = {complete};\n"
    ));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("web_assets.rs");
    std::fs::write(&out, table).expect("OUT_DIR is writable");
}

fn is_file(path: &Path) -> bool {
    path.metadata().is_ok_and(|m| m.is_file())
}
