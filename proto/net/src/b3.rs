//! Zipkin B3 trace context, accepted on incoming calls beside W3C `traceparent`.
//!
//! Service meshes (Istio/Envoy with a Zipkin tracer, older Linkerd set-ups) forward B3 headers,
//! either the single `b3: {trace}-{span}[-{sampled}[-{parent}]]` header or the multi-header
//! form `x-b3-traceid`, `x-b3-spanid`, `x-b3-sampled`, `x-b3-flags`
//! (<https://github.com/openzipkin/b3-propagation>). [`B3`] extracts either, so a request that
//! only carries B3 continues that trace; [`super::trace`] runs it before the W3C propagator,
//! which therefore wins when both are present. Nothing is injected: our outgoing calls carry
//! W3C `traceparent`, which meshes understand as well.
//!
//! Hand-written rather than `opentelemetry-zipkin`'s propagator: that crate is the Zipkin
//! exporter and brings `opentelemetry-http`, `serde_json` and a builder macro crate along
//! for ~100 lines of parsing, and its flags for "debug" and "deferred" are not W3C flags
//! (they would leak into the `traceparent` we send on).

use opentelemetry::Context;
use opentelemetry::propagation::text_map_propagator::FieldIter;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};

const SINGLE: &str = "b3";
const TRACE_ID: &str = "x-b3-traceid";
const SPAN_ID: &str = "x-b3-spanid";
const SAMPLED: &str = "x-b3-sampled";
const FLAGS: &str = "x-b3-flags";

static FIELDS: [String; 0] = [];

/// Extracts B3 trace context (single header first, then the multi-header form); injects
/// nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct B3;

impl TextMapPropagator for B3 {
    fn inject_context(&self, _context: &Context, _injector: &mut dyn Injector) {}

    fn extract_with_context(&self, context: &Context, extractor: &dyn Extractor) -> Context {
        match extract(extractor) {
            Some(remote) => context.with_remote_span_context(remote),
            None => context.clone(),
        }
    }

    /// The fields this propagator writes: none.
    fn fields(&self) -> FieldIter<'_> {
        FieldIter::new(&FIELDS)
    }
}

/// The remote span context in B3 headers, if they hold a valid one. A malformed `b3` header
/// falls back to the multi-header form; anything malformed there is ignored.
pub fn extract(extractor: &dyn Extractor) -> Option<SpanContext> {
    extractor
        .get(SINGLE)
        .and_then(single)
        .or_else(|| multi(extractor))
}

/// `{trace}-{span}[-{sampling}[-{parent}]]`. A lone sampling state (`0`, `1`, `d`) carries no
/// context.
fn single(value: &str) -> Option<SpanContext> {
    let parts: Vec<&str> = value.trim().split('-').collect();
    let (trace, span, sampling, parent) = match parts.as_slice() {
        [trace, span] => (*trace, *span, None, None),
        [trace, span, sampling] => (*trace, *span, Some(*sampling), None),
        [trace, span, sampling, parent] => (*trace, *span, Some(*sampling), Some(*parent)),
        _ => return None,
    };
    if parent.is_some_and(|parent| span_id(parent).is_none()) {
        return None;
    }
    let sampled = match sampling {
        None => None,
        Some("1" | "d") => Some(true),
        Some("0") => Some(false),
        Some(_) => return None,
    };
    context(trace_id(trace)?, span_id(span)?, sampled)
}

fn multi(extractor: &dyn Extractor) -> Option<SpanContext> {
    let trace = trace_id(extractor.get(TRACE_ID)?.trim())?;
    let span = span_id(extractor.get(SPAN_ID)?.trim())?;
    // `x-b3-flags: 1` is debug, which implies sampled; `true`/`false` are what old Zipkin
    // clients sent.
    let sampled = if extractor.get(FLAGS).map(str::trim) == Some("1") {
        Some(true)
    } else {
        match extractor.get(SAMPLED).map(str::trim) {
            None => None,
            Some("1" | "true") => Some(true),
            Some("0" | "false") => Some(false),
            Some(_) => return None,
        }
    };
    context(trace, span, sampled)
}

/// A remote context. No sampling decision ("deferred") means the receiver decides: ours is to
/// record (every process samples everything it is asked to), so it counts as sampled.
fn context(trace: TraceId, span: SpanId, sampled: Option<bool>) -> Option<SpanContext> {
    let flags = if sampled.unwrap_or(true) {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let context = SpanContext::new(trace, span, flags, true, TraceState::default());
    context.is_valid().then_some(context)
}

/// 32 or 16 lower-case hex digits; a 64-bit id is the low half of a 128-bit one.
fn trace_id(hex: &str) -> Option<TraceId> {
    if !(hex.len() == 32 || hex.len() == 16) || !lower_hex(hex) {
        return None;
    }
    u128::from_str_radix(hex, 16).ok().map(TraceId::from)
}

/// 16 lower-case hex digits.
fn span_id(hex: &str) -> Option<SpanId> {
    if hex.len() != 16 || !lower_hex(hex) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok().map(SpanId::from)
}

fn lower_hex(text: &str) -> bool {
    text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN: &str = "00f067aa0ba902b7";

    /// What `headers` yield: `(trace id, span id, sampled)`, or `None`.
    fn check(headers: &[(&str, &str)], expect: Option<(&str, &str, bool)>) {
        let map: HashMap<String, String> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let got = extract(&map).map(|c| {
            (
                c.trace_id().to_string(),
                c.span_id().to_string(),
                c.is_sampled(),
            )
        });
        let expect = expect.map(|(t, s, sampled)| (t.to_owned(), s.to_owned(), sampled));
        assert_eq!(got, expect, "{headers:?}");
    }

    #[test]
    fn single_header() {
        let full = format!("{TRACE}-{SPAN}");
        check(&[("b3", &full)], Some((TRACE, SPAN, true)));
        check(&[("b3", &format!("{full}-1"))], Some((TRACE, SPAN, true)));
        check(&[("b3", &format!("{full}-0"))], Some((TRACE, SPAN, false)));
        check(&[("b3", &format!("{full}-d"))], Some((TRACE, SPAN, true)));
        check(
            &[("b3", &format!("{full}-1-000000000000abcd"))],
            Some((TRACE, SPAN, true)),
        );
        // A 64-bit trace id is padded on the left.
        check(
            &[("b3", &format!("a3ce929d0e0e4736-{SPAN}-1"))],
            Some(("0000000000000000a3ce929d0e0e4736", SPAN, true)),
        );
    }

    #[test]
    fn multi_header() {
        check(
            &[("x-b3-traceid", TRACE), ("x-b3-spanid", SPAN)],
            Some((TRACE, SPAN, true)),
        );
        check(
            &[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "0"),
            ],
            Some((TRACE, SPAN, false)),
        );
        check(
            &[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "true"),
                ("x-b3-parentspanid", "000000000000abcd"),
            ],
            Some((TRACE, SPAN, true)),
        );
        // Debug overrides a "not sampled".
        check(
            &[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "0"),
                ("x-b3-flags", "1"),
            ],
            Some((TRACE, SPAN, true)),
        );
    }

    #[test]
    fn single_header_wins_over_multi_and_falls_back_when_malformed() {
        let other = "11111111111111111111111111111111";
        check(
            &[
                ("b3", &format!("{TRACE}-{SPAN}-1")),
                ("x-b3-traceid", other),
                ("x-b3-spanid", SPAN),
            ],
            Some((TRACE, SPAN, true)),
        );
        check(
            &[
                ("b3", "garbage"),
                ("x-b3-traceid", other),
                ("x-b3-spanid", SPAN),
            ],
            Some((other, SPAN, true)),
        );
    }

    #[test]
    fn malformed_input_is_ignored() {
        let upper = TRACE.to_uppercase();
        let bad: &[&[(&str, &str)]] = &[
            &[],
            &[("b3", "0")],
            &[("b3", "1")],
            &[("b3", "-")],
            &[("b3", "")],
            &[("b3", &*format!("{upper}-{SPAN}"))],
            &[("b3", &*format!("{TRACE}-{SPAN}-x"))],
            &[("b3", &*format!("{TRACE}-{SPAN}-1-xyz"))],
            &[("b3", &*format!("{TRACE}-{SPAN}-1-000000000000abcd-extra"))],
            &[("b3", &*format!("{TRACE}-00f067aa0ba902"))],
            &[("b3", &*format!("{TRACE}1-{SPAN}"))],
            // All-zero ids are invalid.
            &[("b3", &*format!("00000000000000000000000000000000-{SPAN}"))],
            &[("b3", &*format!("{TRACE}-0000000000000000"))],
            &[("x-b3-traceid", TRACE)],
            &[("x-b3-spanid", SPAN)],
            &[("x-b3-traceid", "nothex"), ("x-b3-spanid", SPAN)],
            &[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "maybe"),
            ],
            // A sign is not a hex digit (from_str_radix would take "+").
            &[("x-b3-traceid", "+bf92f3577b34da6"), ("x-b3-spanid", SPAN)],
        ];
        for headers in bad {
            check(headers, None);
        }
    }

    #[test]
    fn the_propagator_leaves_a_context_alone_without_b3() {
        let empty: HashMap<String, String> = HashMap::new();
        let context = B3.extract(&empty);
        assert!(!context.span().span_context().is_valid());
        let mut injected: HashMap<String, String> = HashMap::new();
        B3.inject_context(&context, &mut injected);
        assert!(injected.is_empty());
    }
}
