//! Bounded everything: a client that never finishes its headers is cut off, one address (or
//! many, for one session) cannot hold more connections and watches than its share, 10,000 idle
//! watch streams within their shares are all served, and all the while another learner's
//! lifecycle goes on.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use antidote_tests::config::secs;
use antidote_tests::web::Web;
use futures::StreamExt as _;
use hyper::StatusCode;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

use crate::{Env, Knobs, PATIENCE};

/// A connection to `to` from the loopback address `from` (any of 127.0.0.0/8 is ours).
async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(from), 0))?;
    socket.connect(to).await
}

/// Whether the server closed `stream` (EOF or reset) within `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test]
async fn slowloris_and_a_flood_of_watches_leave_a_learner_unharmed() {
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config().with_limits(|l| {
                l.connections_per_address = Some(8);
                l.watches_per_session = Some(4);
                l.watches_per_address = Some(6);
                l.header_read_timeout = Some(secs(3));
            }),
            ..Knobs::default()
        },
    )
    .await;
    let base = env.scheduler.process.extra_url("http").unwrap();
    let http: SocketAddr = base.trim_start_matches("http://").parse().unwrap();

    // Slowloris: headers trickled a byte at a time are cut off after the header timeout.
    let mut slow = TcpStream::connect(http).await.unwrap();
    slow.write_all(b"GET /v1/lessons HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let trickle = async {
        for _ in 0..40 {
            if slow.write_all(b"X").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(6), trickle).await;
    assert!(
        closed_within(&mut slow, Duration::from_secs(5)).await,
        "a client trickling its headers is still connected"
    );

    // 10,000 connections from 500 addresses, each asking to watch: each address keeps at
    // most 8 connections (the rest are closed at once), and the session at most 4 watches.
    // (An address's 20 connections are made within milliseconds, far inside the 3 s after which
    // an idle keep-alive connection is closed and gives its place back.)
    // The attacker: one session with a live lesson of its own, whose token it sends as the
    // session cookie from every address.
    let (watched, token) = {
        let browser = Web::default();
        let created = browser
            .post(&format!("{base}/v1/sessions"), "")
            .await
            .unwrap();
        let json = created.json().unwrap();
        let (id, token) = (
            json["id"].as_str().unwrap().to_owned(),
            json["token"].as_str().unwrap().to_owned(),
        );
        let owned = browser
            .post(
                &format!("{base}/v1/live-lessons"),
                &format!(r#"{{"sessionId": "{id}", "lessonSlug": "netcat-toolbox"}}"#),
            )
            .await
            .unwrap();
        assert_eq!(owned.status, StatusCode::OK, "{}", owned.body);
        (
            owned.json().unwrap()["id"].as_str().unwrap().to_owned(),
            token,
        )
    };
    let request = format!(
        "GET /v1/live-lessons/{watched}/watch HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\
         Cookie: antidote_session={token}\r\n\r\n"
    );
    let mut open = Vec::new();
    let (mut refused, mut watching, mut limited) = (0, 0, 0);
    for address in 0..500u32 {
        let from = Ipv4Addr::new(127, 1, (address / 250) as u8, (address % 250 + 1) as u8);
        for _ in 0..20 {
            let Ok(mut stream) = connect_from(from, http).await else {
                refused += 1;
                continue;
            };
            if stream.write_all(request.as_bytes()).await.is_err() {
                refused += 1;
                continue;
            }
            open.push(stream);
        }
    }
    // Read each answer's status line (closed ones read EOF at once).
    for stream in &mut open {
        let mut head = [0u8; 12];
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut head)).await {
            Ok(Ok(n)) if n >= 12 && &head[9..12] == b"200" => watching += 1,
            Ok(Ok(n)) if n >= 12 && &head[9..12] == b"429" => limited += 1,
            _ => refused += 1,
        }
    }
    assert_eq!(watching, 4, "the session holds its 4 watches and no more");
    assert_eq!(
        watching + limited,
        500 * 8,
        "each address kept 8 connections (refused {refused})"
    );
    assert_eq!(refused, 10_000 - 500 * 8);

    // Meanwhile a learner from 127.0.0.1 runs a whole lifecycle, over gRPC and over HTTP.
    learner_lifecycle(&env, &base).await;
    drop(open);
}

/// A client that connects and sends nothing is closed after `limits.header_read_timeout`, on
/// every listener (learners' gRPC and HTTP, admin gRPC and HTTP), while calls go on meanwhile.
/// (hyper-util's protocol sniffing and tonic's wait for the HTTP/2 preface have no timer of
/// their own: before the first-byte guard such sockets stayed open for good.)
#[tokio::test]
async fn silent_connections_are_closed_on_every_listener() {
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config().with_limits(|l| l.header_read_timeout = Some(secs(2))),
            ..Knobs::default()
        },
    )
    .await;
    let process = &env.scheduler.process;
    let listeners = [
        ("grpc", process.addr),
        ("http", process.extra["http"]),
        ("admin", process.extra["admin"]),
        ("admin http", process.extra["admin http"]),
    ];
    let mut silent = Vec::new();
    for (i, (name, addr)) in listeners.iter().enumerate() {
        for n in 0..25u8 {
            let from = Ipv4Addr::new(127, 3, i as u8, n + 1);
            silent.push((*name, connect_from(from, *addr).await.unwrap()));
        }
    }
    // Meanwhile a learner's calls are answered, over gRPC and HTTP.
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&live.id).await.unwrap();
    let lessons = Web::default()
        .get(&format!(
            "{}/v1/lessons",
            process.extra_url("http").unwrap()
        ))
        .await
        .unwrap();
    assert_eq!(lessons.status, StatusCode::OK, "{}", lessons.body);
    // Every silent socket is closed by the server (EOF or reset), not by us.
    for (name, stream) in &mut silent {
        assert!(
            closed_within(stream, PATIENCE).await,
            "a silent connection to the {name} listener is still open"
        );
    }
    // And the learner's own connection still serves.
    c.delete(&live.id, PATIENCE).await.unwrap();
}

/// Addresses added to the loopback interface for one test, removed when dropped.
struct LoopbackAddresses(Vec<&'static str>);

impl LoopbackAddresses {
    fn add(addresses: &[&'static str]) -> LoopbackAddresses {
        let mut added = LoopbackAddresses(Vec::new());
        for address in addresses {
            let status = std::process::Command::new("ip")
                .args([
                    "-6",
                    "addr",
                    "add",
                    &format!("{address}/64"),
                    "dev",
                    "lo",
                    "nodad",
                ])
                .status()
                .expect("ip runs");
            assert!(
                status.success(),
                "ip -6 addr add {address}/64 dev lo: {status}"
            );
            added.0.push(address);
        }
        added
    }
}

impl Drop for LoopbackAddresses {
    fn drop(&mut self) {
        for address in &self.0 {
            let _ = std::process::Command::new("ip")
                .args(["-6", "addr", "del", &format!("{address}/64"), "dev", "lo"])
                .status();
        }
    }
}

/// The per-address session limit counts an IPv6 client by its /64: with a limit of 1, a second
/// address of the same /64 is refused a session (429, TOO_MANY_SESSIONS), an address of
/// another /64 is not. Real sockets bound to real addresses on the loopback interface.
#[tokio::test]
async fn a_second_session_from_the_same_ipv6_64_is_refused() {
    let addresses = ["fd00:15:64:1::a", "fd00:15:64:1::b", "fd00:15:64:2::a"];
    let _added = LoopbackAddresses::add(&addresses);
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config()
                .with_sessions_per_ip(1)
                .with_http_listen("[::]:0"),
            ..Knobs::default()
        },
    )
    .await;
    let port = env.scheduler.process.extra["http"].port();
    let create = |from: &'static str| async move {
        let socket = TcpSocket::new_v6().unwrap();
        socket
            .bind(SocketAddr::new(from.parse().unwrap(), 0))
            .unwrap();
        let to = SocketAddr::new(addresses[0].parse().unwrap(), port);
        let mut stream = socket.connect(to).await.unwrap();
        stream
            .write_all(
                b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                  Content-Length: 2\r\nConnection: close\r\n\r\n{}",
            )
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(PATIENCE, stream.read_to_string(&mut answer))
            .await
            .expect("an answer")
            .unwrap();
        answer
    };
    let first = create(addresses[0]).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let same_64 = create(addresses[1]).await;
    assert!(
        same_64.starts_with("HTTP/1.1 429") && same_64.contains("TOO_MANY_SESSIONS"),
        "a second address of the /64 got: {same_64}"
    );
    let other_64 = create(addresses[2]).await;
    assert!(other_64.starts_with("HTTP/1.1 200"), "{other_64}");
}

/// 10,000 idle Watch streams held open at once, over SSE, by 2,500 sessions from 1,250 loopback
/// addresses (each within its limits: 4 watches a session, 8 connections and watches an
/// address), leave another learner's whole lifecycle (gRPC and SSE) unharmed; every one of them
/// is still open afterwards. No global cap an attacker could fill stands in the way: each
/// stream is bounded by its session's and address's share only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_watch_streams_leave_a_learner_unharmed() {
    const ADDRESSES: u32 = 1_250;
    // 10,000 sockets on each side: the test's and the scheduler's (inherited) descriptor limit
    // must allow them, whatever the machine's default (root may raise its own hard limit).
    let _ = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &std::process::id().to_string(),
            "--nofile=65536:65536",
        ])
        .status();
    let env = Env::start(
        &["--null"],
        Knobs {
            config: Env::config().with_lessons_per_session(1).with_limits(|l| {
                l.connections_per_address = Some(8);
                l.watches_per_session = Some(4);
                l.watches_per_address = Some(8);
            }),
            ..Knobs::default()
        },
    )
    .await;
    let base = env.scheduler.process.extra_url("http").unwrap();
    let http: SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    let c = &env.scheduler.clients;

    // 2,500 sessions, one READY live lesson each (the agent does no work).
    let owned: Vec<(String, String)> = futures::stream::iter(0..2 * ADDRESSES)
        .map(|_| async {
            let session = c.session().await.unwrap();
            let live = c.request(&session, "hello-web", 0).await.unwrap();
            let token = c.tokens.of_session(&session).expect("the session's token");
            (live.id, token)
        })
        .buffer_unordered(32)
        .collect()
        .await;

    // Each address watches two sessions' live lessons, four streams each.
    let mut open = Vec::with_capacity(10_000);
    for address in 0..ADDRESSES {
        let from = Ipv4Addr::new(127, 2, (address / 250) as u8, (address % 250 + 1) as u8);
        for n in 0..8 {
            let (id, token) = &owned[(2 * address + n / 4) as usize];
            let mut stream = connect_from(from, http)
                .await
                .unwrap_or_else(|err| panic!("connection {n} from {from}: {err}"));
            stream
                .write_all(
                    format!(
                        "GET /v1/live-lessons/{id}/watch HTTP/1.1\r\nHost: x\r\n\
                         Accept: text/event-stream\r\nCookie: antidote_session={token}\r\n\r\n"
                    )
                    .as_bytes(),
                )
                .await
                .unwrap();
            open.push(stream);
        }
    }
    let mut watching = 0;
    for stream in &mut open {
        let mut head = [0u8; 12];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_secs(10), stream.read(&mut head)).await
            && n >= 12
            && &head[9..12] == b"200"
        {
            watching += 1;
        }
    }
    assert_eq!(watching, 10_000, "every stream within its limits is served");

    // Meanwhile a learner runs a whole lifecycle over gRPC, then one over HTTP with SSE.
    learner_lifecycle(&env, &base).await;

    // The idle streams were not cut to make room: none has been closed.
    let mut still_open = 0;
    for stream in &mut open {
        let mut byte = [0u8; 1024];
        match tokio::time::timeout(Duration::from_millis(1), stream.read(&mut byte)).await {
            // Nothing to read (idle) or more of the event stream: open.
            Err(_) => still_open += 1,
            Ok(Ok(n)) if n > 0 => still_open += 1,
            _ => {}
        }
    }
    assert_eq!(still_open, 10_000, "idle streams were closed");
}

/// A learner from 127.0.0.1 runs a whole lifecycle over gRPC, then one over HTTP, following it
/// to READY over SSE.
async fn learner_lifecycle(env: &Env, base: &str) {
    let c = &env.scheduler.clients;
    let learner = c.session().await.unwrap();
    let live = c.request(&learner, "hello-web", 0).await.unwrap();
    c.ready(&live.id).await.unwrap();
    c.delete(&live.id, PATIENCE).await.unwrap();
    let browser = Web::default();
    let created = browser
        .post(&format!("{base}/v1/sessions"), "")
        .await
        .unwrap();
    let id = created.json().unwrap()["id"].as_str().unwrap().to_owned();
    let requested = browser
        .post(
            &format!("{base}/v1/live-lessons"),
            &format!(r#"{{"sessionId": "{id}", "lessonSlug": "hello-web"}}"#),
        )
        .await
        .unwrap();
    assert_eq!(requested.status, StatusCode::OK, "{}", requested.body);
    let live = requested.json().unwrap()["id"].as_str().unwrap().to_owned();
    let mut events = browser
        .events(&format!("{base}/v1/live-lessons/{live}/watch"))
        .await
        .unwrap();
    let ready = tokio::time::timeout(PATIENCE, async {
        while let Some(event) = events.next().await.unwrap() {
            if event.data.contains("LIVE_LESSON_STATUS_READY") {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(ready, "the learner's lesson became READY over SSE");
}
