//! The configuration reference (`docs/src/reference/configuration.md`), generated from the
//! scheduler's own definitions in `scheduler-svc/src/settings.rs`: every key reachable from
//! `Config` with its type, its default (the expression in the struct's `Default`
//! implementation, evaluated where it is a literal, a duration or an address), its environment
//! variable and its doc comment.

use std::collections::BTreeMap;
use std::fmt::Write;

use syn::{Expr, Fields, Item, Lit, Type};

/// What the generator knows of one struct of the settings file.
struct Struct {
    doc: String,
    fields: Vec<Field>,
    /// Field initialisers of `impl Default`, by field name.
    defaults: Option<BTreeMap<String, Expr>>,
    /// `#[derive(Default)]`: every field takes its type's default.
    derives_default: bool,
}

struct Field {
    name: String,
    ty: Type,
    doc: String,
    /// `#[serde(with = "humantime_serde")]`: written as `30s`, `10m`.
    humantime: bool,
    /// `#[serde(default)]` on the field: its type's default when absent.
    serde_default: bool,
}

/// Types defined outside the settings file, as a reader writes them.
const FOREIGN: &[(&str, &str)] = &[
    ("Database", "path of an SQLite file, or a `postgres://` URL"),
    ("Tier", "`prod`, `ptr` or `local`"),
    (
        "PoolWindow",
        "`{ from = \"HH:MM\", to = \"HH:MM\", size = N }`",
    ),
];

/// The page, from the text of `settings.rs`.
pub fn render(source: &str) -> String {
    let file = syn::parse_file(source).expect("scheduler-svc/src/settings.rs parses");
    let mut structs = BTreeMap::new();
    let mut enums = BTreeMap::new();
    for item in &file.items {
        match item {
            Item::Struct(s) => {
                let Fields::Named(named) = &s.fields else {
                    continue;
                };
                let fields = named
                    .named
                    .iter()
                    .map(|f| Field {
                        name: f.ident.as_ref().expect("a named field").to_string(),
                        ty: f.ty.clone(),
                        doc: doc(&f.attrs),
                        humantime: serde_with(&f.attrs).as_deref() == Some("humantime_serde"),
                        serde_default: serde_flag(&f.attrs, "default"),
                    })
                    .collect();
                structs.insert(
                    s.ident.to_string(),
                    Struct {
                        doc: doc(&s.attrs),
                        fields,
                        defaults: None,
                        derives_default: derives(&s.attrs, "Default"),
                    },
                );
            }
            Item::Enum(e) => {
                let names: Vec<String> = e
                    .variants
                    .iter()
                    .map(|v| {
                        serde_rename(&v.attrs).unwrap_or_else(|| v.ident.to_string().to_lowercase())
                    })
                    .collect();
                enums.insert(e.ident.to_string(), names);
            }
            _ => {}
        }
    }
    for item in &file.items {
        let Item::Impl(imp) = item else { continue };
        let Some((_, trait_path, _)) = &imp.trait_ else {
            continue;
        };
        if trait_path
            .segments
            .last()
            .is_none_or(|s| s.ident != "Default")
        {
            continue;
        }
        let Type::Path(self_ty) = &*imp.self_ty else {
            continue;
        };
        let name = self_ty
            .path
            .segments
            .last()
            .expect("a type name")
            .ident
            .to_string();
        let Some(body) = imp.items.iter().find_map(|i| match i {
            syn::ImplItem::Fn(f) if f.sig.ident == "default" => Some(&f.block),
            _ => None,
        }) else {
            continue;
        };
        let Some(syn::Stmt::Expr(Expr::Struct(init), None)) = body.stmts.last() else {
            panic!("`impl Default for {name}` does not end with a struct expression");
        };
        let defaults = init
            .fields
            .iter()
            .map(|fv| {
                let syn::Member::Named(ident) = &fv.member else {
                    panic!("{name}: unnamed field in Default");
                };
                (ident.to_string(), fv.expr.clone())
            })
            .collect();
        if let Some(s) = structs.get_mut(&name) {
            s.defaults = Some(defaults);
        }
    }

    let generator = Generator {
        structs: &structs,
        enums: &enums,
    };
    let mut rows = Vec::new();
    generator.walk("Config", "", Some("ANTIDOTE_"), &mut rows);

    let mut out = String::new();
    out.push_str(
        "# Configuration keys\n\n\
         <!-- Generated from scheduler-svc/src/settings.rs by the `docs` test \
         (tests/docs/config.rs); do not edit: `ANTIDOTE_BLESS=1 cargo test -p antidote-tests \
         --test docs` writes it again. -->\n\n\
         `scheduler-svc serve --config FILE` reads a TOML or YAML file, then `ANTIDOTE_*` \
         environment variables with `__` between levels, which win over the file. A bad value \
         stops start-up with an error naming the key. Durations are written as `30s`, `10m`, \
         `24h`; addresses as `HOST:PORT` (port 0: any free port, printed at start-up). Keys \
         inside an array of tables (`[[agents]]`, `[[admin.tokens]]`, ...) have no variable of \
         their own; `ANTIDOTE_AGENTS=name=address,name=address` sets `agents` as a list.\n\n",
    );
    out.push_str("| key | type | default | environment | meaning |\n|---|---|---|---|---|\n");
    for row in rows {
        writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            row.key,
            cell(&row.ty),
            cell(&row.default),
            row.env.map_or("—".to_owned(), |e| format!("`{e}`")),
            cell(&row.doc)
        )
        .unwrap();
    }
    out
}

struct Row {
    key: String,
    ty: String,
    default: String,
    env: Option<String>,
    doc: String,
}

struct Generator<'a> {
    structs: &'a BTreeMap<String, Struct>,
    enums: &'a BTreeMap<String, Vec<String>>,
}

impl Generator<'_> {
    /// Rows for every key of struct `name` under `prefix`; `env` is the variable prefix, `None`
    /// inside an array of tables.
    fn walk(&self, name: &str, prefix: &str, env: Option<&str>, rows: &mut Vec<Row>) {
        let s = &self.structs[name];
        for f in &s.fields {
            let key = format!("{prefix}{}", f.name);
            let var = env.map(|e| format!("{e}{}", f.name.to_uppercase()));
            let default_expr = s.defaults.as_ref().and_then(|d| d.get(&f.name));
            let (outer, inner) = wrapper(&f.ty);
            if let Some(sub) = inner.filter(|t| self.structs.contains_key(t.as_str())) {
                match outer.as_deref() {
                    None => {
                        // A table: its keys, each with its own variable.
                        let sub_env = var.as_ref().map(|v| format!("{v}__"));
                        rows.push(Row {
                            key: format!("[{key}]"),
                            ty: "table".into(),
                            default: "".into(),
                            env: None,
                            doc: self.structs[&sub].doc.clone(),
                        });
                        self.walk(&sub, &format!("{key}."), sub_env.as_deref(), rows);
                    }
                    Some("Option") => {
                        rows.push(Row {
                            key: format!("[{key}]"),
                            ty: "table, optional".into(),
                            default: "unset".into(),
                            env: None,
                            doc: join(&f.doc, &self.structs[&sub].doc),
                        });
                        let sub_env = var.as_ref().map(|v| format!("{v}__"));
                        self.walk(&sub, &format!("{key}."), sub_env.as_deref(), rows);
                    }
                    Some("Vec") => {
                        rows.push(Row {
                            key: format!("[[{key}]]"),
                            ty: "array of tables".into(),
                            default: "none".into(),
                            env: if key == "agents" { var } else { None },
                            doc: join(&f.doc, &self.structs[&sub].doc),
                        });
                        self.walk(&sub, &format!("{key}[]."), None, rows);
                    }
                    Some(other) => panic!("`{key}`: a {other} of tables is not described"),
                }
                continue;
            }
            let default = match default_expr {
                Some(expr) => self.value(expr, f.humantime),
                None if s.derives_default || f.serde_default => zero(&f.ty),
                None => match outer.as_deref() {
                    Some("Option") => "unset".into(),
                    Some("Vec") | Some("BTreeMap") => "none".into(),
                    _ => "required".into(),
                },
            };
            rows.push(Row {
                key,
                ty: self.type_name(&f.ty, f.humantime),
                default,
                env: var,
                doc: f.doc.clone(),
            });
        }
    }

    /// How a reader writes a value of `ty`.
    fn type_name(&self, ty: &Type, humantime: bool) -> String {
        let (outer, inner) = wrapper(ty);
        let inner = inner.unwrap_or_default();
        let base = |t: &str| -> String {
            match t {
                "Duration" if humantime => "duration".into(),
                "SocketAddr" => "address".into(),
                "PathBuf" => "path".into(),
                "String" => "string".into(),
                "bool" => "boolean".into(),
                "u16" | "u32" | "u64" | "usize" => "integer".into(),
                other => {
                    if let Some(variants) = self.enums.get(other) {
                        variants
                            .iter()
                            .map(|v| format!("`{v}`"))
                            .collect::<Vec<_>>()
                            .join(" or ")
                    } else if let Some((_, said)) = FOREIGN.iter().find(|(n, _)| *n == other) {
                        (*said).to_owned()
                    } else {
                        panic!(
                            "settings type `{other}` is not described: add it to FOREIGN in \
                             tests/docs/config.rs"
                        )
                    }
                }
            }
        };
        match outer.as_deref() {
            None => base(&inner),
            Some("Option") => format!("{}, optional", base(&inner)),
            Some("Vec") => format!("list of {}", plural(&base(&inner))),
            Some("BTreeMap") => format!("table of {}", plural(&base(&inner))),
            Some(other) => panic!("settings wrapper `{other}` is not described"),
        }
    }

    /// A default as a reader would write it.
    fn value(&self, expr: &Expr, humantime: bool) -> String {
        if humantime && let Some(secs) = duration_secs(expr) {
            return format!("`{}`", duration(secs));
        }
        match expr {
            Expr::Lit(l) => format!("`{}`", lit(&l.lit)),
            Expr::MethodCall(m)
                if ["into", "to_owned", "to_string"].contains(&m.method.to_string().as_str()) =>
            {
                self.value(&m.receiver, humantime)
            }
            Expr::Path(p) => {
                let last = p.path.segments.last().expect("a path").ident.to_string();
                match last.as_str() {
                    "None" => "unset".into(),
                    _ if p.path.segments.len() > 1 => format!("`{}`", last.to_lowercase()),
                    other => format!("`{other}`"),
                }
            }
            Expr::Call(c) => {
                let Expr::Path(func) = &*c.func else {
                    return code(expr);
                };
                let segs: Vec<String> = func
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let last = segs.last().map(String::as_str).unwrap_or("");
                match (last, c.args.len()) {
                    ("new" | "default", 0)
                        if segs
                            .first()
                            .is_some_and(|s| s == "String" || s == "PathBuf") =>
                    {
                        "empty".into()
                    }
                    ("new" | "default", 0) => "none".into(),
                    ("Some", 1) => self.value(&c.args[0], humantime),
                    ("from", 1) if segs.first().is_some_and(|s| s == "SocketAddr") => {
                        socket_addr(&c.args[0]).unwrap_or_else(|| code(expr))
                    }
                    (_, 1) => self.value(&c.args[0], humantime),
                    _ => code(expr),
                }
            }
            _ => code(expr),
        }
    }
}

/// `(Some("Option"), Some("T"))` for `Option<T>`, `(None, Some("T"))` for a plain `T`; maps
/// give their value type.
fn wrapper(ty: &Type) -> (Option<String>, Option<String>) {
    let Type::Path(p) = ty else {
        return (None, None);
    };
    let last = p.path.segments.last().expect("a type path");
    let name = last.ident.to_string();
    if let syn::PathArguments::AngleBracketed(args) = &last.arguments {
        let inner = args.args.iter().rev().find_map(|a| match a {
            syn::GenericArgument::Type(Type::Path(t)) => {
                Some(t.path.segments.last().expect("a type").ident.to_string())
            }
            _ => None,
        });
        return (Some(name), inner);
    }
    (None, Some(name))
}

/// The default of a type that derives it.
fn zero(ty: &Type) -> String {
    match wrapper(ty) {
        (Some(o), _) if o == "Option" => "unset".into(),
        (Some(_), _) => "none".into(),
        (None, Some(t)) => match t.as_str() {
            "bool" => "`false`".into(),
            "String" | "PathBuf" => "empty".into(),
            "u16" | "u32" | "u64" | "usize" => "`0`".into(),
            other => panic!("no zero value described for `{other}`"),
        },
        _ => panic!("unexpected type"),
    }
}

/// Seconds of `Duration::from_secs(expr)` / `from_millis(expr)` with integer arithmetic.
fn duration_secs(expr: &Expr) -> Option<std::time::Duration> {
    let Expr::Call(c) = expr else { return None };
    let Expr::Path(func) = &*c.func else {
        return None;
    };
    let last = func.path.segments.last()?.ident.to_string();
    let n = int(c.args.first()?)?;
    match last.as_str() {
        "from_secs" => Some(std::time::Duration::from_secs(n)),
        "from_millis" => Some(std::time::Duration::from_millis(n)),
        _ => None,
    }
}

fn int(expr: &Expr) -> Option<u64> {
    match expr {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Int(i), ..
        }) => i.base10_parse().ok(),
        Expr::Binary(b) => {
            let (l, r) = (int(&b.left)?, int(&b.right)?);
            match b.op {
                syn::BinOp::Mul(_) => Some(l * r),
                syn::BinOp::Add(_) => Some(l + r),
                _ => None,
            }
        }
        Expr::Paren(p) => int(&p.expr),
        _ => None,
    }
}

/// `SocketAddr::from(([127, 0, 0, 1], 7070))` as `127.0.0.1:7070`.
fn socket_addr(arg: &Expr) -> Option<String> {
    let Expr::Tuple(t) = arg else { return None };
    let Expr::Array(ip) = t.elems.first()? else {
        return None;
    };
    let octets: Option<Vec<String>> = ip
        .elems
        .iter()
        .map(|e| int(e).map(|n| n.to_string()))
        .collect();
    let port = int(t.elems.get(1)?)?;
    Some(format!("`{}:{port}`", octets?.join(".")))
}

fn lit(l: &Lit) -> String {
    match l {
        Lit::Str(s) => s.value(),
        Lit::Int(i) => i.base10_digits().to_owned(),
        Lit::Bool(b) => b.value.to_string(),
        other => quote::ToTokens::to_token_stream(other).to_string(),
    }
}

fn code(expr: &Expr) -> String {
    format!("`{}`", quote::ToTokens::to_token_stream(expr))
}

/// The `///` lines of an item, as one paragraph.
fn doc(attrs: &[syn::Attribute]) -> String {
    let lines: Vec<String> = attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .filter_map(|a| match &a.meta {
            syn::Meta::NameValue(nv) => match &nv.value {
                Expr::Lit(syn::ExprLit {
                    lit: Lit::Str(s), ..
                }) => Some(s.value().trim().to_owned()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    lines.join(" ").trim().to_owned()
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_owned(),
        (_, true) => a.to_owned(),
        _ => format!("{a} {b}"),
    }
}

/// The `with = "..."` of a field's `#[serde(...)]`.
fn serde_with(attrs: &[syn::Attribute]) -> Option<String> {
    serde_value(attrs, "with")
}

/// Whether a field's `#[serde(...)]` holds the bare word `flag`.
fn serde_flag(attrs: &[syn::Attribute], flag: &str) -> bool {
    let mut found = false;
    for a in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = a.parse_nested_meta(|meta| {
            if meta.input.peek(syn::Token![=]) {
                let _: Expr = meta.value()?.parse()?;
            } else if meta.path.is_ident(flag) {
                found = true;
            }
            Ok(())
        });
    }
    found
}

/// `string` → `strings`; descriptions of other types stay as they are.
fn plural(base: &str) -> String {
    match base {
        "string" | "path" | "integer" | "address" | "duration" => format!("{base}s"),
        other => other.to_owned(),
    }
}

/// A duration as the configuration writes it: the largest unit that divides it.
fn duration(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    let secs = d.as_secs();
    if !ms.is_multiple_of(1000) {
        format!("{ms}ms")
    } else if secs != 0 && secs.is_multiple_of(7 * 86_400) {
        format!("{}d", secs / 86_400)
    } else if secs != 0 && secs.is_multiple_of(3600) {
        format!("{}h", secs / 3600)
    } else if secs != 0 && secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}

fn serde_rename(attrs: &[syn::Attribute]) -> Option<String> {
    serde_value(attrs, "rename")
}

fn serde_value(attrs: &[syn::Attribute], key: &str) -> Option<String> {
    let mut found = None;
    for a in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = a.parse_nested_meta(|meta| {
            if meta.path.is_ident(key) {
                let s: syn::LitStr = meta.value()?.parse()?;
                found = Some(s.value());
            } else if meta.input.peek(syn::Token![=]) {
                let _: Expr = meta.value()?.parse()?;
            }
            Ok(())
        });
    }
    found
}

fn derives(attrs: &[syn::Attribute], name: &str) -> bool {
    let mut found = false;
    for a in attrs.iter().filter(|a| a.path().is_ident("derive")) {
        let _ = a.parse_nested_meta(|meta| {
            if meta.path.is_ident(name) {
                found = true;
            }
            Ok(())
        });
    }
    found
}

/// A table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}
