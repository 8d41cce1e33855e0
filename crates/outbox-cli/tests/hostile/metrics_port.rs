//! The metrics port under a flood of half-sent requests (SECURITY.md: anyone who can reach the
//! metrics port): the relay, started with a small file-descriptor budget as a container may
//! give it, keeps answering `/healthz` to another client and keeps delivering to its webhook;
//! a slow header and an idle keep-alive connection are cut after `metrics.header_timeout`; the
//! port never holds more than `metrics.max_connections` sockets.

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::{Killed, Outputs, common};

/// The relay's descriptor budget: 19,995 half-sent requests exhausted a real one; 256 makes a
/// thousand enough here.
const FD_LIMIT: u32 = 256;

/// A connection to `to` from the loopback address `from` (any of 127/8 is this machine, so
/// clients can come from several addresses).
async fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from.parse::<IpAddr>().unwrap(), 0))?;
    socket.connect(to).await
}

/// `GET path` from `from` over a fresh connection; the status line, or the failure (no answer
/// within 3 s is one).
async fn get_from(from: &str, to: SocketAddr, path: &str) -> Result<String, String> {
    tokio::time::timeout(Duration::from_secs(3), get_from_now(from, to, path))
        .await
        .unwrap_or_else(|_| Err("no answer within 3 s".to_owned()))
}

async fn get_from_now(from: &str, to: SocketAddr, path: &str) -> Result<String, String> {
    let mut stream = connect_from(from, to).await.map_err(|e| e.to_string())?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&answer);
    Ok(text.lines().next().unwrap_or("").to_owned())
}

/// How long until the server closes `stream` (reads return end of file or an error), while
/// `feed` writes to it now and then; at most `limit`.
async fn closed_after(mut stream: TcpStream, limit: Duration, trickle: bool) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        if started.elapsed() > limit {
            return started.elapsed();
        }
        if trickle {
            // One more header line every 300 ms: never a complete request.
            if stream.write_all(b"x-slow: 1\r\n").await.is_err() {
                return started.elapsed();
            }
        }
        match tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            Ok(Ok(_)) | Err(_) => {}
        }
    }
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_sent_requests_neither_stops_healthz_nor_delivery() {
    let delivered = Arc::new(AtomicUsize::new(0));
    let counted = delivered.clone();
    let receiver = Router::new().fallback(move || {
        let counted = counted.clone();
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            "ok"
        }
    });
    let hook_port = common::serve(receiver).await;
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics: SocketAddr = format!("127.0.0.1:{metrics_port}").parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let config = common::write_config(
        dir.path(),
        &format!(
            r#"
[database]
url = "sqlite://{db}?mode=rwc"

[relay]
poll_interval = "20ms"

[metrics]
listen = "{metrics}"
header_timeout = "2s"

[destinations.hooks]
type = "webhook"
url = "http://127.0.0.1:{hook_port}/events/${{aggregate_id}}"
"#,
            db = db.display(),
        ),
    );
    let mut outputs = Outputs::default();
    outputs.succeeds(
        "migrate",
        &["migrate", "--config", config.to_str().unwrap()],
    );
    let log = dir.path().join("relay.log");
    // A descriptor budget as a container might set it.
    let relay = Killed(
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ulimit -n {FD_LIMIT} && exec {} relay --config {}",
                common::BIN,
                config.display()
            ))
            .env("OUTBOX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = relay.0.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    while get_from("127.0.0.1", metrics, "/healthz").await.as_deref() != Ok("HTTP/1.1 200 OK") {
        assert!(
            Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The flood: from 127.0.0.1, half-sent requests as fast as they connect, each kept open by
    // the client (the 2,000 newest), for as long as the test runs.
    let flooding = Arc::new(AtomicBool::new(true));
    let opened = Arc::new(AtomicUsize::new(0));
    let flood = {
        let flooding = flooding.clone();
        let opened = opened.clone();
        tokio::spawn(async move {
            let mut held = std::collections::VecDeque::new();
            while flooding.load(Ordering::SeqCst) {
                let connecting = connect_from("127.0.0.1", metrics);
                match tokio::time::timeout(Duration::from_secs(1), connecting).await {
                    Ok(Ok(mut stream)) => {
                        let _ = stream
                            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
                            .await;
                        opened.fetch_add(1, Ordering::SeqCst);
                        held.push_back(stream);
                        if held.len() > 2_000 {
                            held.pop_front();
                        }
                    }
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while opened.load(Ordering::SeqCst) < 1_000 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // `/healthz` answers another client at once, however long the flood lasts.
    let mut slowest = Duration::ZERO;
    let mut most_fds = 0;
    for _ in 0..10 {
        let asked = Instant::now();
        let answer = get_from("127.0.0.2", metrics, "/healthz").await;
        assert_eq!(
            answer.as_deref(),
            Ok("HTTP/1.1 200 OK"),
            "with {} flood connections opened, the relay holding {} descriptors",
            opened.load(Ordering::SeqCst),
            open_fds(pid)
        );
        slowest = slowest.max(asked.elapsed());
        most_fds = most_fds.max(open_fds(pid));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // The relay keeps delivering to its webhook.
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    for n in 0..5 {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, headers,
                                        occurred_at, enqueued_at, next_attempt_at)
             VALUES ('0193a0c0-0000-7000-8000-00000000002{n}', 'acct', 'a{n}', 'Flooded', '{{}}', '{{}}',
                     unixepoch() * 1000000, unixepoch() * 1000000, unixepoch() * 1000000)"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while delivered.load(Ordering::SeqCst) < 5 {
        assert!(
            Instant::now() < deadline,
            "delivered {} of 5 during the flood\n{}",
            delivered.load(Ordering::SeqCst),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    most_fds = most_fds.max(open_fds(pid));

    // A slow header from another address is cut after the header timeout (2 s); so is an idle
    // keep-alive connection after its response.
    let mut slow = connect_from("127.0.0.3", metrics).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    let cut = closed_after(slow, Duration::from_secs(10), true).await;
    assert!(
        cut >= Duration::from_millis(1_700) && cut < Duration::from_secs(4),
        "a slow header was cut after {cut:?}"
    );
    let mut idle = connect_from("127.0.0.4", metrics).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: relay\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 256];
    let n = idle.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let idle_cut = closed_after(idle, Duration::from_secs(10), false).await;
    assert!(
        idle_cut >= Duration::from_millis(1_700) && idle_cut < Duration::from_secs(4),
        "an idle keep-alive connection was closed after {idle_cut:?}"
    );

    flooding.store(false, Ordering::SeqCst);
    flood.await.unwrap();
    let fds = open_fds(pid);
    drop(relay);
    println!(
        "flood: {} half-sent connections; /healthz from another address: slowest {slowest:?}; relay descriptors: at most {most_fds} of {FD_LIMIT} (64 connections allowed, 16 per address); slow header cut after {cut:?}, idle keep-alive after {idle_cut:?}; {fds} descriptors at the end",
        opened.load(Ordering::SeqCst)
    );
    assert!(most_fds < 150, "the port held {most_fds} descriptors");
    outputs.add_file("relay log", &log);
    outputs.check_for(&[]);
}
