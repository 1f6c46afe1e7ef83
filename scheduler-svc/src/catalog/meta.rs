//! Reading `curriculum.meta.yaml`, `collection.meta.yaml` and `image.meta.yaml`, plus what all
//! the `*.meta.yaml` readers share: slugs and the shape of a parse result.

use serde_yaml::Value;

use super::model::{Collection, CollectionType, CurriculumMeta, Flavor, Image, Tier};
use super::yaml::{FileProblems, Node};

/// What reading one `*.meta.yaml` file produced.
///
/// The slug and tier are kept even when the rest of the file is broken, so that references to
/// a broken item (an endpoint's image, a lesson's prereq) do not pile a second, misleading
/// "does not exist" error on top of the real one.
pub(super) struct Parsed<T> {
    /// The slug as written, if the file had one.
    pub(super) slug: Option<String>,
    /// The tier as written, for the kinds of item that have one.
    pub(super) tier: Option<Tier>,
    /// The item, only if its file had no problem at all.
    pub(super) item: Option<T>,
}

impl<T> Parsed<T> {
    /// A file that could not be read as a mapping at all.
    pub(super) fn nothing() -> Self {
        Self {
            slug: None,
            tier: None,
            item: None,
        }
    }
}

/// Which characters a kind of slug may use, and how to say so.
pub(super) struct SlugRule {
    /// What a message calls the rule, e.g. `^[a-z0-9-]+$`.
    pub(super) pattern: &'static str,
    /// Whether a character is allowed.
    pub(super) allows: fn(char) -> bool,
}

/// Lesson slugs appear in URLs and resource names, so Antidote kept them to `^[a-z0-9-]+$`.
pub(super) const LESSON_SLUG: SlugRule = SlugRule {
    pattern: "^[a-z0-9-]+$",
    allows: |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-',
};

/// Collection slugs, `^[a-z-]+$`, exactly as Antidote had them (no digits).
pub(super) const COLLECTION_SLUG: SlugRule = SlugRule {
    pattern: "^[a-z-]+$",
    allows: |c| c.is_ascii_lowercase() || c == '-',
};

/// Image slugs, `^[A-Za-z0-9-]+$`, as Antidote's image schema had them.
pub(super) const IMAGE_SLUG: SlugRule = SlugRule {
    pattern: "^[A-Za-z0-9-]+$",
    allows: |c| c.is_ascii_alphanumeric() || c == '-',
};

/// Reads the required `slug` key and checks it against `rule`. The slug is returned even when
/// it breaks the rule (having reported that), for the reason given on [`Parsed`].
pub(super) fn slug(node: &Node<'_>, rule: &SlugRule, report: &mut FileProblems) -> Option<String> {
    let slug = node.required_string("slug", report)?;
    if !slug.chars().all(rule.allows) {
        report.error(
            node.field("slug"),
            format!("`{slug}` does not match {}", rule.pattern),
        );
    }
    Some(slug)
}

/// `curriculum.meta.yaml`.
pub(super) fn curriculum(value: &Value, report: &mut FileProblems) -> Option<CurriculumMeta> {
    const KEYS: &[&str] = &["name", "description", "website", "aVer", "gitRoot"];
    let before = report.count();
    let node = Node::open("", value, KEYS, report)?;
    let name = node.required_string("name", report);
    let meta = CurriculumMeta {
        name: name.unwrap_or_default(),
        description: node.text("description", report),
        website: node.string("website", report),
        a_ver: node.string("aVer", report),
        git_root: node.string("gitRoot", report),
    };
    (report.count() == before).then_some(meta)
}

/// `collections/<dir>/collection.meta.yaml`.
pub(super) fn collection(value: &Value, report: &mut FileProblems) -> Parsed<Collection> {
    const KEYS: &[&str] = &[
        "slug",
        "title",
        "image",
        "website",
        "contactEmail",
        "briefDescription",
        "longDescription",
        "type",
        "tier",
    ];
    let before = report.count();
    let Some(node) = Node::open("", value, KEYS, report) else {
        return Parsed::nothing();
    };
    let slug = slug(&node, &COLLECTION_SLUG, report);
    let title = node.required_string("title", report);
    let image = node.string("image", report);
    let website = node.string("website", report);
    let contact_email = node.string("contactEmail", report);
    let brief_description = node.text("briefDescription", report);
    let long_description = node.text("longDescription", report);
    let kind = node.choice::<CollectionType>("type", true, report);
    let tier = node.choice::<Tier>("tier", true, report);
    let item = match (&slug, title, kind, tier) {
        (Some(slug), Some(title), Some(kind), Some(tier)) if report.count() == before => {
            Some(Collection {
                slug: slug.clone(),
                title,
                image,
                website,
                contact_email,
                brief_description,
                long_description,
                kind,
                tier,
            })
        }
        _ => None,
    };
    Parsed { slug, tier, item }
}

/// `images/<dir>/image.meta.yaml`.
pub(super) fn image(value: &Value, report: &mut FileProblems) -> Parsed<Image> {
    const KEYS: &[&str] = &[
        "slug",
        "description",
        "flavor",
        "sshUser",
        "sshPassword",
        "configUser",
        "configPassword",
        "enableForwarding",
        "networkInterfaces",
    ];
    let before = report.count();
    let Some(node) = Node::open("", value, KEYS, report) else {
        return Parsed::nothing();
    };
    let slug = slug(&node, &IMAGE_SLUG, report);
    let description = node.text("description", report);
    let flavor = node.choice::<Flavor>("flavor", true, report);
    let ssh_user = node.string("sshUser", report);
    let ssh_password = node.string("sshPassword", report);
    let config_user = node.string("configUser", report);
    let config_password = node.string("configPassword", report);
    let enable_forwarding = node.flag("enableForwarding", report);
    let network_interfaces = node.strings("networkInterfaces", report);
    for (index, interface) in network_interfaces.iter().enumerate() {
        let field = format!("{}[{index}]", node.field("networkInterfaces"));
        if interface == "eth0" {
            // Every container's first interface is its management network; connections
            // attached to it would bridge lessons into that network.
            report.error(
                field,
                "`eth0` is reserved for the management network and cannot carry connections",
            );
        } else if network_interfaces[..index].contains(interface) {
            report.error(field, format!("`{interface}` is listed twice"));
        }
    }
    let item = match (&slug, flavor) {
        (Some(slug), Some(flavor)) if report.count() == before => Some(Image {
            slug: slug.clone(),
            description,
            flavor,
            ssh_user,
            ssh_password,
            config_user,
            config_password,
            enable_forwarding,
            network_interfaces,
        }),
        _ => None,
    };
    Parsed {
        slug,
        tier: None,
        item,
    }
}
