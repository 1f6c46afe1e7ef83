//! Readiness from where learners connect: a READY state checked against its spec, with every
//! presentation probed from here.

use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::PresentationType;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::report::summary;

/// Probes a presentation from here: an SSH banner, or an HTTP status line to GET /.
pub async fn probe(kind: i32, address: &str) -> anyhow::Result<String> {
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        if kind == PresentationType::Http as i32 {
            stream
                .write_all(b"GET / HTTP/1.0\r\nHost: conformance\r\n\r\n")
                .await?;
        }
        let mut buf = vec![0u8; 256];
        let mut n = 0;
        while n < 8 {
            let read = stream.read(&mut buf[n..]).await?;
            if read == 0 {
                break;
            }
            n += read;
        }
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    let head = tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .map_err(|_| anyhow!("{address}: no answer within 5 s"))?
        .with_context(|| address.to_owned())?;
    let expected = if kind == PresentationType::Http as i32 {
        "HTTP/"
    } else {
        "SSH-"
    };
    ensure!(
        head.starts_with(expected),
        "{address} answered {:?}, not {expected}…",
        head.lines().next().unwrap_or_default()
    );
    Ok(head.lines().next().unwrap_or_default().to_owned())
}

/// Checks a READY state against its spec, probing every presentation.
pub async fn check_ready(
    state: &proto::LiveLessonState,
    spec: &proto::LessonSpec,
) -> anyhow::Result<String> {
    ensure!(
        state.generation == spec.generation && state.stage == spec.stage,
        "READY state is {}, expected generation {} stage {}",
        summary(state),
        spec.generation,
        spec.stage
    );
    let names: Vec<_> = state.endpoints.iter().map(|e| e.name.as_str()).collect();
    let expected: Vec<_> = spec.endpoints.iter().map(|e| e.name.as_str()).collect();
    ensure!(
        names == expected,
        "endpoints {names:?}, expected {expected:?} in lesson order"
    );
    for (key, value) in &spec.labels {
        ensure!(
            state.labels.get(key) == Some(value),
            "state label {key} is {:?}, expected {value:?}",
            state.labels.get(key)
        );
    }
    let mut probed = 0;
    for (endpoint, wanted) in state.endpoints.iter().zip(&spec.endpoints) {
        ensure!(
            endpoint.total == wanted.presentations.len() as u32
                && endpoint.healthy == endpoint.total,
            "endpoint `{}` reports {}/{} healthy, expected {}/{}",
            endpoint.name,
            endpoint.healthy,
            endpoint.total,
            wanted.presentations.len(),
            wanted.presentations.len()
        );
        for presentation in &wanted.presentations {
            let Some(reported) = endpoint
                .presentations
                .iter()
                .find(|p| p.name == presentation.name)
            else {
                bail!(
                    "endpoint `{}` does not report presentation `{}`",
                    endpoint.name,
                    presentation.name
                );
            };
            ensure!(
                !reported.address.is_empty(),
                "presentation `{}/{}` has no address",
                endpoint.name,
                presentation.name
            );
            if presentation.r#type == PresentationType::Http as i32 {
                ensure!(
                    reported.url.starts_with("http"),
                    "http presentation `{}/{}` has no url",
                    endpoint.name,
                    presentation.name
                );
            }
            probe(presentation.r#type, &reported.address)
                .await
                .with_context(|| format!("probing `{}/{}`", endpoint.name, presentation.name))?;
            probed += 1;
        }
    }
    Ok(format!(
        "{} endpoints in order, {probed} presentations answer their probes from here",
        names.len()
    ))
}

/// Every presentation's address, in endpoint and presentation order.
pub fn addresses(state: &proto::LiveLessonState) -> Vec<String> {
    state
        .endpoints
        .iter()
        .flat_map(|e| e.presentations.iter().map(|p| p.address.clone()))
        .collect()
}

/// An HTTP answer, body read whole.
#[derive(Debug)]
pub struct Page {
    /// The status.
    pub status: hyper::StatusCode,
    /// The body as text (invalid UTF-8 replaced).
    pub body: String,
}

/// GET of `url` (plain HTTP/1.1), as a learner's browser would fetch a presentation's file.
pub async fn get(url: &str) -> anyhow::Result<Page> {
    use http_body_util::{BodyExt as _, Empty};
    use hyper::body::Bytes;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let fetch = async {
        let response = client
            .get(url.parse().with_context(|| format!("not a URL: {url}"))?)
            .await
            .with_context(|| format!("GET {url}"))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .with_context(|| format!("GET {url}: reading the body"))?
            .to_bytes();
        Ok::<_, anyhow::Error>(Page {
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        })
    };
    tokio::time::timeout(Duration::from_secs(30), fetch)
        .await
        .map_err(|_| anyhow!("GET {url}: no answer within 30 s"))?
}
