//! `entrypoint-bench`: agent-docker's entrypoint against going straight to the endpoint,
//! measured in the same run.
//!
//! One `terminal` live lesson (tests/fixtures/entrypoint-curriculum: `antidote/sshd`, a real SSH
//! server on 22 and busybox httpd on 8080) through the scheduler, then, interleaved in each
//! round:
//! - terminal round trip: N keystrokes, each sent and timed until the PTY's echo returns, through
//!   the entrypoint's WebSocket terminal and over a direct SSH session (russh) to the published
//!   port; both run `cat >/dev/null`, so the kernel's line discipline echoes every key;
//! - HTTP: R requests at concurrency C through the entrypoint's proxy (the token in its cookie,
//!   one keep-alive client pool) and straight to the published port (the same client);
//!   throughput and latency percentiles.
//!
//! It prints each round, the totals with their ratios (goal: ≤ 1.2× and p99 added < 5 ms), and
//! the median and spread of the rounds' p50 ratios (the machine may be shared: rounds vary).
//! Needs DOCKER_HOST (tests/docker/dockerd.sh start) and `antidote/sshd`
//! (tests/docker/configurator.sh sshd). Build with `cargo build --release --workspace --bins`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_tests::{Process, Scheduler, presentation, workspace_bin};
use anyhow::{Context as _, bail};
use clap::Parser;
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use russh::ChannelMsg;
use russh::client;
use tokio_tungstenite::tungstenite::Message;

/// The scheduler's signing key (a test key, `openssl genpkey -algorithm ed25519`).
const KEY: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIOJpnp+MXLCEBFZDaMoT0KXNBLMvX5FYtd/znqWpkio2
-----END PRIVATE KEY-----
";
/// `antidote/sshd`'s login (the fixture's image.meta.yaml).
const SSH_USER: &str = "antidote";
const SSH_PASSWORD: &str = "antidotepassword";

#[derive(Parser)]
#[command(
    name = "entrypoint-bench",
    about = "agent-docker's entrypoint against direct SSH and HTTP"
)]
struct Args {
    /// Keystrokes per round and path.
    #[arg(long, default_value_t = 500)]
    keystrokes: usize,
    /// HTTP requests per round and path.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Concurrent HTTP clients.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Rounds (direct and entrypoint alternate within each).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::env::var("DOCKER_HOST")
        .context("DOCKER_HOST is not set: run `tests/docker/dockerd.sh start` and export it")?;
    let dir = tempfile::tempdir()?;
    let agent = Process::spawn(
        &workspace_bin("agent-docker"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--entrypoint-listen".into(),
            "127.0.0.1:0".into(),
            "--entrypoint-max-per-client".into(),
            (args.concurrency + 16).to_string(),
        ],
        dir.path().join("agent.log"),
    )
    .await?;
    let key = dir.path().join("k1.pem");
    std::fs::write(&key, KEY)?;
    let curriculum = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/entrypoint-curriculum")
        .canonicalize()?;
    let config = format!(
        "instance_id = \"entrypoint-bench\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
         [limits]\nsessions_per_ip = 0\n[reconciler]\npoll_interval = \"500ms\"\n\
         [entrypoint]\nkeys = [{{ id = \"k1\", file = \"{}\" }}]\ntoken_ttl = \"2h\"\n\
         [[agents]]\nname = \"docker\"\naddress = \"{}\"\n",
        curriculum.display(),
        key.display(),
        agent.url()
    );
    let scheduler = Scheduler::start(dir.path(), &config).await?;
    let c = scheduler.clients.clone();
    let lesson = c.request(&c.session().await?, "terminal", 0).await?;
    let lesson = c
        .ready(&lesson.id)
        .await
        .with_context(|| format!("the lesson never got READY\n{}", agent.log_text()))?;
    let cli = presentation(&lesson, "box", "cli");
    let web = presentation(&lesson, "box", "web");
    // Learners get entrypoint URLs only; the backend addresses are the operator's (admin) view.
    let admin = c
        .admin
        .clone()
        .get_live_lesson(api::AdminGetLiveLessonRequest {
            id: lesson.id.clone(),
        })
        .await?
        .into_inner()
        .live_lesson
        .context("the admin answer holds the live lesson")?;
    let (cli_backend, web_backend) = (
        presentation(&admin, "box", "cli"),
        presentation(&admin, "box", "web"),
    );
    let ssh_addr: SocketAddr = cli_backend
        .address
        .parse()
        .with_context(|| format!("the ssh presentation's address {:?}", cli_backend.address))?;
    let web_addr: SocketAddr = web_backend
        .address
        .parse()
        .with_context(|| format!("the http presentation's address {:?}", web_backend.address))?;
    let (entry_page, token) = web
        .entrypoint_url
        .split_once("?antidote_token=")
        .context("the web presentation's entrypoint URL has no token")?;
    let http_entry = HttpTarget {
        uri: entry_page.to_owned(),
        cookie: Some(format!("antidote_entrypoint={token}")),
    };
    let http_direct = HttpTarget {
        uri: format!("http://{web_addr}/"),
        cookie: None,
    };

    let mut via_entry = EntryTerminal::open(&cli.entrypoint_url).await?;
    let mut direct = SshTerminal::open(ssh_addr).await?;
    // Warm up both paths.
    via_entry.keystrokes(20).await?;
    direct.keystrokes(20).await?;
    let client: Client<HttpConnector, Empty<Bytes>> = {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(args.concurrency)
            .build(connector)
    };
    http_round(&client, &http_direct, 100, args.concurrency).await?;
    http_round(&client, &http_entry, 100, args.concurrency).await?;

    println!(
        "entrypoint-bench: {} keystrokes and {} HTTP requests at concurrency {} per round and path, {} rounds",
        args.keystrokes, args.requests, args.concurrency, args.rounds
    );
    let mut totals = Totals::default();
    for round in 1..=args.rounds {
        // Alternate which path goes first.
        let (d_keys, e_keys, d_http, e_http) = if round % 2 == 1 {
            let d = direct.keystrokes(args.keystrokes).await?;
            let e = via_entry.keystrokes(args.keystrokes).await?;
            let dh = http_round(&client, &http_direct, args.requests, args.concurrency).await?;
            let eh = http_round(&client, &http_entry, args.requests, args.concurrency).await?;
            (d, e, dh, eh)
        } else {
            let e = via_entry.keystrokes(args.keystrokes).await?;
            let d = direct.keystrokes(args.keystrokes).await?;
            let eh = http_round(&client, &http_entry, args.requests, args.concurrency).await?;
            let dh = http_round(&client, &http_direct, args.requests, args.concurrency).await?;
            (d, e, dh, eh)
        };
        print_round(
            &format!("round {round}"),
            &d_keys,
            &e_keys,
            &d_http,
            &e_http,
        );
        totals.add(d_keys, e_keys, d_http, e_http);
    }
    totals.print();
    via_entry.close().await;
    c.delete(&lesson.id, Duration::from_secs(120)).await?;
    Ok(())
}

/// The value at quantile `q` of sorted samples, in ms.
fn quantile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// One path's HTTP round: latencies and wall time.
#[derive(Default)]
struct HttpRun {
    latencies: Vec<Duration>,
    wall: Duration,
}

impl HttpRun {
    fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.wall.as_secs_f64()
    }
}

fn print_round(
    label: &str,
    d_keys: &[Duration],
    e_keys: &[Duration],
    d_http: &HttpRun,
    e_http: &HttpRun,
) {
    let sorted = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    let (dk, ek) = (sorted(d_keys), sorted(e_keys));
    let (dh, eh) = (sorted(&d_http.latencies), sorted(&e_http.latencies));
    println!(
        "{label}: terminal echo p50/p99 ms: direct {:.2}/{:.2}, entrypoint {:.2}/{:.2} \
         (p50 ratio {:.2}, p99 added {:.2} ms)",
        quantile(&dk, 0.5),
        quantile(&dk, 0.99),
        quantile(&ek, 0.5),
        quantile(&ek, 0.99),
        quantile(&ek, 0.5) / quantile(&dk, 0.5),
        quantile(&ek, 0.99) - quantile(&dk, 0.99),
    );
    println!(
        "{label}: HTTP req/s direct {:.0}, entrypoint {:.0} (direct/entrypoint {:.2}); \
         p50/p99 ms direct {:.2}/{:.2}, entrypoint {:.2}/{:.2} (p50 ratio {:.2}, p99 added {:.2} ms)",
        d_http.throughput(),
        e_http.throughput(),
        d_http.throughput() / e_http.throughput(),
        quantile(&dh, 0.5),
        quantile(&dh, 0.99),
        quantile(&eh, 0.5),
        quantile(&eh, 0.99),
        quantile(&eh, 0.5) / quantile(&dh, 0.5),
        quantile(&eh, 0.99) - quantile(&dh, 0.99),
    );
}

/// Every round's samples together, and each round's p50 ratios.
#[derive(Default)]
struct Totals {
    d_keys: Vec<Duration>,
    e_keys: Vec<Duration>,
    d_http: HttpRun,
    e_http: HttpRun,
    /// Per round: the terminal's and HTTP's p50 ratio (entrypoint / direct).
    ratios: Vec<(f64, f64)>,
}

/// The p50 of unsorted samples, in ms.
fn p50(samples: &[Duration]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort();
    quantile(&sorted, 0.5)
}

/// Min, median and max of `values`.
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    (values[0], median, values[n - 1])
}

impl Totals {
    fn add(&mut self, d_keys: Vec<Duration>, e_keys: Vec<Duration>, d: HttpRun, e: HttpRun) {
        self.ratios.push((
            p50(&e_keys) / p50(&d_keys),
            p50(&e.latencies) / p50(&d.latencies),
        ));
        self.d_keys.extend(d_keys);
        self.e_keys.extend(e_keys);
        self.d_http.latencies.extend(d.latencies);
        self.d_http.wall += d.wall;
        self.e_http.latencies.extend(e.latencies);
        self.e_http.wall += e.wall;
    }

    fn print(&self) {
        print_round(
            "all rounds",
            &self.d_keys,
            &self.e_keys,
            &self.d_http,
            &self.e_http,
        );
        let (t_min, t_med, t_max) = spread(self.ratios.iter().map(|r| r.0).collect());
        let (h_min, h_med, h_max) = spread(self.ratios.iter().map(|r| r.1).collect());
        println!(
            "per-round p50 ratios (median, min–max): terminal {t_med:.2} ({t_min:.2}–{t_max:.2}), \
             HTTP {h_med:.2} ({h_min:.2}–{h_max:.2})"
        );
    }
}

/// Where HTTP requests go.
struct HttpTarget {
    uri: String,
    cookie: Option<String>,
}

/// `requests` GETs at `concurrency`, each timed until its whole body arrived.
async fn http_round(
    client: &Client<HttpConnector, Empty<Bytes>>,
    target: &HttpTarget,
    requests: usize,
    concurrency: usize,
) -> anyhow::Result<HttpRun> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, next) = (client.clone(), next.clone());
        let uri: hyper::Uri = target.uri.parse()?;
        let cookie = target.cookie.clone();
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
                let mut request = hyper::Request::get(uri.clone());
                if let Some(cookie) = &cookie {
                    request = request.header(hyper::header::COOKIE, cookie);
                }
                let request = request.body(Empty::<Bytes>::new())?;
                let sent = Instant::now();
                let response = client.request(request).await?;
                let status = response.status();
                let body = response.into_body().collect().await?.to_bytes();
                latencies.push(sent.elapsed());
                if !status.is_success() || body.is_empty() {
                    bail!("GET {uri}: {status}");
                }
            }
            Ok::<_, anyhow::Error>(latencies)
        }));
    }
    let mut run = HttpRun::default();
    for worker in workers {
        run.latencies.extend(worker.await??);
    }
    run.wall = started.elapsed();
    Ok(run)
}

/// The keys typed: a–z, then a newline for `cat` to take the line.
fn key(i: usize) -> u8 {
    b'a' + (i % 26) as u8
}

/// The entrypoint's WebSocket terminal.
struct EntryTerminal {
    ws: tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
}

impl EntryTerminal {
    async fn open(url: &str) -> anyhow::Result<EntryTerminal> {
        let ws_url = url.replacen("http://", "ws://", 1);
        let authority = ws_url
            .strip_prefix("ws://")
            .and_then(|r| r.split('/').next())
            .context("an http:// entrypoint URL")?
            .to_owned();
        let stream = tokio::net::TcpStream::connect(&authority).await?;
        stream.set_nodelay(true)?;
        let (ws, _) = tokio_tungstenite::client_async(ws_url, stream).await?;
        let mut terminal = EntryTerminal { ws };
        terminal.send(b"exec cat >/dev/null\r").await?;
        terminal.until(b"exec cat >/dev/null").await?;
        // Whatever the shell still prints settles before the first timed key.
        tokio::time::sleep(Duration::from_millis(300)).await;
        while let Ok(Some(_)) =
            tokio::time::timeout(Duration::from_millis(100), terminal.ws.next()).await
        {}
        Ok(terminal)
    }

    async fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.ws.send(Message::Binary(bytes.to_vec().into())).await?;
        Ok(())
    }

    /// Reads output until `want` shows.
    async fn until(&mut self, want: &[u8]) -> anyhow::Result<()> {
        let mut seen = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(message) = self.ws.next().await {
                if let Message::Binary(bytes) = message? {
                    seen.extend_from_slice(&bytes);
                    if seen.windows(want.len()).any(|w| w == want) {
                        return Ok(());
                    }
                }
            }
            bail!("the terminal closed")
        })
        .await;
        read.unwrap_or_else(|_| bail!("no echo in 30 s"))
    }

    async fn keystrokes(&mut self, n: usize) -> anyhow::Result<Vec<Duration>> {
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let sent = Instant::now();
            self.send(&[key(i)]).await?;
            self.until(&[key(i)]).await?;
            times.push(sent.elapsed());
            if i % 60 == 59 {
                self.send(b"\r").await?;
                self.until(b"\n").await?;
            }
        }
        Ok(times)
    }

    async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }
}

struct Trusting;

impl client::Handler for Trusting {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        _key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

/// A direct SSH session with a shell on a PTY.
struct SshTerminal {
    _session: client::Handle<Trusting>,
    channel: russh::Channel<client::Msg>,
}

impl SshTerminal {
    async fn open(addr: SocketAddr) -> anyhow::Result<SshTerminal> {
        let config = Arc::new(client::Config {
            nodelay: true,
            ..Default::default()
        });
        let mut session = client::connect(config, addr, Trusting).await?;
        if !session
            .authenticate_password(SSH_USER, SSH_PASSWORD)
            .await?
            .success()
        {
            bail!("{addr} refused {SSH_USER}'s password");
        }
        let channel = session.channel_open_session().await?;
        channel
            .request_pty(false, "xterm-256color", 80, 24, 0, 0, &[])
            .await?;
        channel.request_shell(false).await?;
        let mut terminal = SshTerminal {
            _session: session,
            channel,
        };
        terminal.channel.data(&b"exec cat >/dev/null\r"[..]).await?;
        terminal.until(b"exec cat >/dev/null").await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        while let Ok(Some(_)) =
            tokio::time::timeout(Duration::from_millis(100), terminal.channel.wait()).await
        {
        }
        Ok(terminal)
    }

    async fn until(&mut self, want: &[u8]) -> anyhow::Result<()> {
        let mut seen = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(message) = self.channel.wait().await {
                match message {
                    ChannelMsg::Data { data } | ChannelMsg::ExtendedData { data, .. } => {
                        seen.extend_from_slice(&data);
                        if seen.windows(want.len()).any(|w| w == want) {
                            return Ok(());
                        }
                    }
                    ChannelMsg::Close | ChannelMsg::Eof => bail!("the ssh channel closed"),
                    _ => {}
                }
            }
            bail!("the ssh channel closed")
        })
        .await;
        read.unwrap_or_else(|_| bail!("no echo in 30 s"))
    }

    async fn keystrokes(&mut self, n: usize) -> anyhow::Result<Vec<Duration>> {
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let sent = Instant::now();
            self.channel.data(&[key(i)][..]).await?;
            self.until(&[key(i)]).await?;
            times.push(sent.elapsed());
            if i % 60 == 59 {
                self.channel.data(&b"\r"[..]).await?;
                self.until(b"\n").await?;
            }
        }
        Ok(times)
    }
}
