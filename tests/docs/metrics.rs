//! The metrics reference (`docs/src/reference/metrics.md`), from the registries' definitions:
//! each `registry.register(...)` / `register_with_unit(...)` of the scheduler's
//! `scheduler-svc/src/metrics.rs` and the SDK's `proto/sdk/src/metrics.rs` (name, help, unit),
//! the metric it registers (its kind and its label struct's fields). The families a scrape of
//! the real registries shows are checked to be among them, under the same type.

use std::collections::BTreeMap;

use syn::visit::Visit;
use syn::{Expr, Lit, Type};

#[derive(Clone)]
struct Metric {
    name: String,
    help: String,
    unit: Option<String>,
    kind: String,
    labels: Vec<String>,
}

#[derive(Default)]
struct Finder {
    /// `let x = Family::<L, Gauge>::default()`: variable → (label struct, kind).
    locals: BTreeMap<String, (String, String)>,
    /// Label structs and their fields.
    labels: BTreeMap<String, Vec<String>>,
    /// (name, help, unit, variable) of each registration.
    registered: Vec<(String, String, Option<String>, String)>,
}

fn string(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s.value().split_whitespace().collect::<Vec<_>>().join(" ")),
        _ => None,
    }
}

/// `Family::<L, Gauge>` or `HistogramFamily::<L>` in a path: (L, kind).
fn family(path: &syn::Path) -> Option<(String, String)> {
    let seg = path
        .segments
        .iter()
        .find(|s| s.ident == "Family" || s.ident == "HistogramFamily")?;
    let syn::PathArguments::AngleBracketed(args) = &seg.arguments else {
        return None;
    };
    let types: Vec<String> = args
        .args
        .iter()
        .filter_map(|a| match a {
            syn::GenericArgument::Type(Type::Path(t)) => {
                Some(t.path.segments.last()?.ident.to_string())
            }
            _ => None,
        })
        .collect();
    let kind = if seg.ident == "HistogramFamily" {
        "histogram".to_owned()
    } else {
        types.get(1)?.to_lowercase()
    };
    Some((types.first()?.clone(), kind))
}

impl<'ast> Visit<'ast> for Finder {
    fn visit_item_struct(&mut self, s: &'ast syn::ItemStruct) {
        if let syn::Fields::Named(named) = &s.fields {
            self.labels.insert(
                s.ident.to_string(),
                named
                    .named
                    .iter()
                    .filter_map(|f| f.ident.as_ref().map(|i| i.to_string()))
                    .collect(),
            );
        }
        syn::visit::visit_item_struct(self, s);
    }

    fn visit_local(&mut self, local: &'ast syn::Local) {
        if let (syn::Pat::Ident(name), Some(init)) = (&local.pat, &local.init) {
            let mut inner = PathFinder(None);
            inner.visit_expr(&init.expr);
            if let Some(found) = inner.0 {
                self.locals.insert(name.ident.to_string(), found);
            }
        }
        syn::visit::visit_local(self, local);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        let method = call.method.to_string();
        if method == "register" || method == "register_with_unit" {
            let args: Vec<&Expr> = call.args.iter().collect();
            let name = args.first().and_then(|e| string(e));
            let help = args.get(1).and_then(|e| string(e));
            let unit = (method == "register_with_unit")
                .then(|| match args.get(2) {
                    Some(Expr::Path(p)) => p.path.segments.last().map(|s| s.ident.to_string()),
                    _ => None,
                })
                .flatten();
            let metric = args.last().and_then(|e| {
                let mut v = VarFinder(None);
                v.visit_expr(e);
                v.0
            });
            if let (Some(name), Some(help), Some(metric)) = (name, help, metric) {
                self.registered.push((name, help, unit, metric));
            }
        }
        syn::visit::visit_expr_method_call(self, call);
    }
}

struct PathFinder(Option<(String, String)>);
impl<'ast> Visit<'ast> for PathFinder {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        if self.0.is_none() {
            self.0 = family(p);
        }
        syn::visit::visit_path(self, p);
    }
}

struct VarFinder(Option<String>);
impl<'ast> Visit<'ast> for VarFinder {
    fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
        if self.0.is_none() {
            self.0 = p.path.get_ident().map(|i| i.to_string());
        }
    }
}

/// The metrics `source` registers under `prefix`.
fn metrics(source: &str, prefix: &str) -> Vec<Metric> {
    let file = syn::parse_file(source).expect("a metrics module parses");
    let mut finder = Finder::default();
    finder.visit_file(&file);
    assert!(!finder.registered.is_empty(), "no registration found");
    finder
        .registered
        .iter()
        .map(|(name, help, unit, var)| {
            let (labels, kind) = finder
                .locals
                .get(var)
                .unwrap_or_else(|| panic!("`{name}`: no `let {var} = Family::<...>` found"));
            let unit = unit.as_ref().map(|u| u.to_lowercase());
            let mut full = format!("{prefix}_{name}");
            if let Some(u) = &unit {
                full = format!("{full}_{u}");
            }
            if kind == "counter" {
                full.push_str("_total");
            }
            Metric {
                name: full,
                help: help.clone(),
                unit,
                kind: kind.clone(),
                labels: finder.labels.get(labels).cloned().unwrap_or_default(),
            }
        })
        .collect()
}

/// The types of `source` that implement prometheus-client's `Collector`.
fn collectors(source: &str) -> Vec<String> {
    let file = syn::parse_file(source).expect("a metrics module parses");
    file.items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Impl(i) => {
                let (_, path, _) = i.trait_.as_ref()?;
                (path.segments.last()?.ident == "Collector").then(|| match &*i.self_ty {
                    syn::Type::Path(t) => t.path.segments.last().map(|s| s.ident.to_string()),
                    _ => None,
                })?
            }
            _ => None,
        })
        .collect()
}

/// (family, type) of each `# TYPE` line of a scrape.
fn scraped(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_owned(), t.to_owned()))
        .collect()
}

/// The `# HELP` text of `family` in a scrape.
fn scraped_help(text: &str, family: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .find_map(|l| l.strip_prefix(family)?.strip_prefix(' ').map(str::to_owned))
}

/// The table of `list`, with what `collectors` (the names of the source's `Collector`
/// implementations, which encode their metrics at each scrape rather than registering them)
/// add to the scrape, documented from its `# HELP` lines.
fn table(out: &mut String, list: &[Metric], scrape: &str, file: &str, collectors: &[String]) {
    let mut list = list.to_vec();
    for (family, kind) in scraped(scrape) {
        if list
            .iter()
            .any(|m| m.kind == kind && (m.name == family || m.name == format!("{family}_total")))
        {
            continue;
        }
        assert!(
            !collectors.is_empty(),
            "{file}: the scrape shows `{family}` ({kind}), which the generator did not find"
        );
        let help = scraped_help(scrape, &family)
            .unwrap_or_else(|| panic!("{file}: `{family}` has no HELP line"));
        list.push(Metric {
            name: if kind == "counter" {
                format!("{family}_total")
            } else {
                family
            },
            help: help.trim_end_matches('.').to_owned(),
            unit: None,
            kind,
            labels: Vec::new(),
        });
    }
    out.push_str("| metric | type | labels | what it counts |\n|---|---|---|---|\n");
    for m in &list {
        let labels = if m.labels.is_empty() {
            "—".to_owned()
        } else {
            m.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let kind = match &m.unit {
            Some(u) => format!("{} ({u})", m.kind),
            None => m.kind.clone(),
        };
        out.push_str(&format!(
            "| `{}` | {kind} | {labels} | {} |\n",
            m.name,
            m.help.replace('|', "\\|")
        ));
    }
    out.push('\n');
}

/// The page.
pub fn render(repo: &std::path::Path) -> String {
    let mut out = String::from(
        "# Metrics\n\n\
         <!-- Generated from scheduler-svc/src/metrics.rs and proto/sdk/src/metrics.rs by the \
         `docs` test (tests/docs/metrics.rs); do not edit: `ANTIDOTE_BLESS=1 cargo test -p \
         antidote-tests --test docs` writes it again. -->\n\n\
         OpenMetrics text. Where each is served and who may scrape it: \
         [Metrics and traces](../operating/metrics.md). A histogram's samples are \
         `NAME_bucket`, `NAME_sum` and `NAME_count`.\n\n## The scheduler\n\n",
    );
    let file = "scheduler-svc/src/metrics.rs";
    let source = std::fs::read_to_string(repo.join(file)).unwrap();
    let mut scheduler = scheduler_svc::metrics::Metrics::default();
    scheduler.count_store(Default::default());
    let scrape = scheduler.render(&scheduler_svc::store::Counts::default(), []);
    table(
        &mut out,
        &metrics(&source, "antidote"),
        &scrape,
        file,
        &collectors(&source),
    );

    out.push_str("## Every SDK agent (`--metrics-listen`)\n\n");
    let file = "proto/sdk/src/metrics.rs";
    let source = std::fs::read_to_string(repo.join(file)).unwrap();
    let agent = antidote_sdk::metrics::AgentMetrics::default();
    let scrape = agent.render(&antidote_sdk::StateBook::default());
    table(
        &mut out,
        &metrics(&source, "antidote_agent"),
        &scrape,
        file,
        &collectors(&source),
    );
    out
}
