//! `drain`: fill a backlog, run the relay in a child process until it is drained, read its
//! figures back, and print them per run, as a summary and as a table across sinks.

use super::*;

/// Figures of one drain run.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct RunFigures {
    events_per_second: f64,
    seconds: f64,
    relay_cpu_us_per_event: f64,
    relay_peak_rss_mb: f64,
    connect_ms: f64,
    publish_calls: u64,
    events_per_call: f64,
    /// Latency of one `publish` call (one wave: at most one event per aggregate).
    publish_call_ms: Percentiles,
    /// Latency of the call that carried each event.
    publish_event_ms: Percentiles,
    first_call_ms: f64,
    /// Sums of claim / publish / ack durations over the drain's wall time.
    claim_share: f64,
    publish_share: f64,
    ack_share: f64,
    claims: u64,
    empty_claims: u64,
    retried: u64,
    dead: u64,
    released: u64,
    /// What the destination held afterwards (distinct event ids for the webhook).
    destination_received: Option<u64>,
    destination_duplicates: Option<u64>,
    enqueue_events_per_second: f64,
}

/// One sink's result over all runs.
pub(crate) struct SinkSummary {
    kind: SinkKind,
    relay: RelayKind,
    detail: String,
    sink_config: serde_json::Value,
    settings: String,
    runs: Vec<RunFigures>,
}

impl SinkSummary {
    fn median_of(&self, f: impl Fn(&RunFigures) -> f64) -> f64 {
        median(self.runs.iter().map(f).collect())
    }
}

pub(crate) async fn drain(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: DrainArgs,
) -> anyhow::Result<()> {
    let endpoints = args.endpoints()?;
    let kinds = args.sink.kinds();
    let relays = args.relay.kinds();
    let mut results: Vec<(SinkKind, Result<SinkSummary, String>)> = Vec::new();
    for &kind in &kinds {
        let mut rates = Vec::new();
        for &relay in &relays {
            match drain_sink(url, &args, &endpoints, kind, relay).await {
                Ok(summary) => {
                    print_summary(&args, &summary);
                    record(json_out, summary_json(&args, &summary))?;
                    rates.push(summary.median_of(|r| r.events_per_second));
                    if relay == RelayKind::Ours {
                        results.push((kind, Ok(summary)));
                    }
                }
                Err(error) if kinds.len() > 1 || relays.len() > 1 => {
                    eprintln!(
                        "drain --sink {kind} --relay {} failed: {error:#}",
                        relay.name()
                    );
                    if relay == RelayKind::Ours {
                        results.push((kind, Err(format!("{error:#}"))));
                    }
                }
                Err(error) => return Err(error.context(format!("drain --sink {kind}"))),
            }
        }
        if let [ours, naive] = rates[..]
            && naive > 0.0
        {
            println!(
                "drain --sink {kind}: ours {ours:.0} events/s vs the naive baseline {naive:.0} events/s: {:.1}x",
                ours / naive
            );
            record(
                json_out,
                serde_json::json!({"scenario": "drain-vs-baseline", "sink": kind.name(), "events": args.events,
                    "ours_events_per_second": ours, "naive_events_per_second": naive, "ratio": ours / naive}),
            )?;
        }
    }
    if kinds.len() > 1 && relays.contains(&RelayKind::Ours) {
        print_table(&args, &results);
        if results.iter().any(|(_, r)| r.is_err()) {
            bail!("some sinks failed; see above");
        }
    }
    Ok(())
}

pub(crate) async fn drain_sink(
    url: &str,
    args: &DrainArgs,
    endpoints: &Endpoints,
    kind: SinkKind,
    relay: RelayKind,
) -> anyhow::Result<SinkSummary> {
    let schema = schema_name(&format!("drain_{kind}"));
    let mut summary = SinkSummary {
        kind,
        relay,
        detail: String::new(),
        sink_config: serde_json::Value::Null,
        settings: String::new(),
        runs: Vec::new(),
    };
    println!(
        "drain --sink {kind} --relay {}: {}, {} run(s)",
        relay.name(),
        workload(args),
        args.runs.max(1)
    );
    for run in 0..args.runs.max(1) {
        let figures = in_fresh_schema(url, &schema, async |store| {
            drain_run(url, store, args, endpoints, kind, run, &mut summary).await
        })
        .await
        .with_context(|| format!("run {}", run + 1))?;
        print_run(run, &figures);
        summary.runs.push(figures);
    }
    Ok(summary)
}

pub(crate) async fn drain_run(
    url: &str,
    store: &PgStore,
    args: &DrainArgs,
    endpoints: &Endpoints,
    kind: SinkKind,
    run: usize,
    summary: &mut SinkSummary,
) -> anyhow::Result<RunFigures> {
    summary.settings = server_settings(store).await?;
    let fill_secs = fill(store, args.events, args.aggregates, args.payload_bytes).await?;
    crate::execute(
        store,
        format!("VACUUM ANALYZE {}", store.outbox().qualified_table()),
    )
    .await?;

    let name = format!("outbox_bench_{kind}_{}_{}", std::process::id(), run + 1);
    let mut destination = Destination::prepare(kind, endpoints, &name)
        .await
        .with_context(|| format!("preparing the {kind} destination"))?;
    summary.detail = destination.detail.clone();
    summary.sink_config = destination.sink_config.clone();
    let outcome = run_child(
        url,
        store.outbox().schema(),
        args,
        kind,
        summary.relay,
        &destination,
    )
    .await;
    let received = match &outcome {
        Ok(_) => destination.received(args.events).await,
        Err(_) => Ok(None),
    };
    let duplicates = destination.duplicates();
    let cleaned = destination.cleanup().await;
    let report = outcome?;
    let received = received.with_context(|| format!("counting what {kind} received"))?;
    cleaned.with_context(|| format!("cleaning up the {kind} destination"))?;

    if report.delivered < args.events {
        bail!(
            "the relay delivered {} of {} events (retried {}, dead {}, released {}); first failure: {}",
            report.delivered,
            args.events,
            report.relay.retried,
            report.relay.dead,
            report.relay.released,
            report.publish.first_failure.as_deref().unwrap_or("none")
        );
    }
    let stats = store.stats().await?;
    // The naive relay deletes what it sent; ours marks it delivered, or deletes it too.
    let complete = match summary.relay {
        RelayKind::Ours if args.delete_on_ack => {
            stats.pending == 0 && stats.in_flight == 0 && stats.delivered == 0
        }
        RelayKind::Ours => stats.delivered == args.events,
        RelayKind::Naive => stats.pending == 0 && stats.in_flight == 0,
    };
    if !complete {
        bail!("drain incomplete: {stats:?}");
    }
    if let Some(n) = received
        && n < args.events
    {
        bail!(
            "silent loss: the relay and PostgreSQL count {} delivered, but the {kind} destination holds only {n}",
            args.events
        );
    }

    let delivered = report.delivered as f64;
    let share = |secs: f64| {
        if report.seconds > 0.0 {
            secs / report.seconds
        } else {
            0.0
        }
    };
    Ok(RunFigures {
        events_per_second: delivered / report.seconds,
        seconds: report.seconds,
        relay_cpu_us_per_event: report.cpu_seconds / delivered * 1e6,
        relay_peak_rss_mb: report.peak_rss_kb as f64 / 1024.0,
        connect_ms: report.connect_seconds * 1e3,
        publish_calls: report.publish.calls,
        events_per_call: if report.publish.calls > 0 {
            report.publish.events as f64 / report.publish.calls as f64
        } else {
            0.0
        },
        publish_call_ms: report.publish.per_call,
        publish_event_ms: report.publish.per_event,
        first_call_ms: report.publish.first_call_ms,
        claim_share: share(report.store.claim_seconds),
        publish_share: share(report.publish.seconds_total),
        ack_share: share(report.store.ack_seconds),
        claims: report.store.claims,
        empty_claims: report.store.empty_claims,
        retried: report.relay.retried,
        dead: report.relay.dead,
        released: report.relay.released,
        destination_received: received,
        destination_duplicates: duplicates,
        enqueue_events_per_second: args.events as f64 / fill_secs,
    })
}

pub(crate) async fn run_child(
    url: &str,
    schema: &str,
    args: &DrainArgs,
    kind: SinkKind,
    relay: RelayKind,
    destination: &Destination,
) -> anyhow::Result<ChildReport> {
    let exe = std::env::current_exe()?;
    let output = tokio::process::Command::new(exe)
        .args(["--database-url", url, "relay-child", "--schema", schema])
        .args([
            "--expect",
            &args.events.to_string(),
            "--batch-size",
            &args.batch_size.to_string(),
        ])
        .args(["--batches-in-flight", &args.batches_in_flight.to_string()])
        .args(["--sink", kind.name(), "--relay", relay.name()])
        .args(["--poll-interval-ms", &args.poll_interval_ms.to_string()])
        .args([
            "--sink-config",
            &serde_json::to_string(&destination.sink_config)?,
        ])
        .args(args.delete_on_ack.then_some("--delete-on-ack"))
        .stderr(Stdio::inherit())
        .output()
        .await?;
    if !output.status.success() {
        bail!("relay child failed: {:?}", output.status);
    }
    parse_child_report(&output.stdout)
}

/// The relay child's report: the last line of its standard output (the first is `READY`).
pub(crate) fn parse_child_report(stdout: &[u8]) -> anyhow::Result<ChildReport> {
    let text = String::from_utf8_lossy(stdout);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .context("the relay child printed no report")?;
    serde_json::from_str(last).context("relay child output")
}

pub(crate) fn print_run(run: usize, f: &RunFigures) {
    println!(
        "  run {}: {:>8.0} events/s in {:.2} s, relay CPU {:.1} µs/event, peak RSS {:.1} MB; {} publish calls of {:.0} events, call p50 {:.1} / p99 {:.1} / max {:.1} ms, first {:.1} ms",
        run + 1,
        f.events_per_second,
        f.seconds,
        f.relay_cpu_us_per_event,
        f.relay_peak_rss_mb,
        f.publish_calls,
        f.events_per_call,
        f.publish_call_ms.p50_ms,
        f.publish_call_ms.p99_ms,
        f.publish_call_ms.max_ms,
        f.first_call_ms,
    );
    println!(
        "         time in claim {:.0}% ({} claims, {} empty), publish {:.0}%, ack {:.0}%; connect {:.0} ms (not timed); destination holds {}",
        f.claim_share * 100.0,
        f.claims,
        f.empty_claims,
        f.publish_share * 100.0,
        f.ack_share * 100.0,
        f.connect_ms,
        f.destination_received
            .map(|n| n.to_string())
            .unwrap_or_else(|| "(counted by the relay)".into()),
    );
}

pub(crate) fn print_summary(args: &DrainArgs, s: &SinkSummary) {
    let kind = s.kind;
    println!();
    println!(
        "drain  PostgreSQL -> {kind}, {} relay{}  ({} events of {} B over {} aggregates, batch {}, {} batch(es) in flight; relay on the bare sink, no router; {})",
        s.relay.name(),
        if args.delete_on_ack && s.relay == RelayKind::Ours {
            ", acks delete the rows"
        } else {
            ""
        },
        args.events,
        args.payload_bytes,
        args.aggregates,
        args.batch_size,
        args.batches_in_flight,
        s.settings
    );
    println!("  destination: {}", s.detail);
    if kind != SinkKind::Channel {
        println!("  sink config: {}", s.sink_config);
    }
    let target = kind
        .target()
        .map(|t| format!(" (issue 3 target ≥ {t:.0})"))
        .unwrap_or_default();
    println!(
        "  median of {} run(s): {:.0} events/s{target}, relay CPU {:.1} µs/event, peak relay RSS {:.1} MB",
        s.runs.len(),
        s.median_of(|r| r.events_per_second),
        s.median_of(|r| r.relay_cpu_us_per_event),
        s.median_of(|r| r.relay_peak_rss_mb),
    );
    println!(
        "  publish latency per call (one call = one wave of at most one event per aggregate; {:.0} events per call here): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        s.median_of(|r| r.events_per_call),
        s.median_of(|r| r.publish_call_ms.p50_ms),
        s.median_of(|r| r.publish_call_ms.p99_ms),
        s.median_of(|r| r.publish_call_ms.max_ms),
    );
    println!(
        "  publish latency per event (estimated: the latency of the call that carried it): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        s.median_of(|r| r.publish_event_ms.p50_ms),
        s.median_of(|r| r.publish_event_ms.p99_ms),
        s.median_of(|r| r.publish_event_ms.max_ms),
    );
    println!(
        "  relay wall time in claim {:.0}%, publish {:.0}%, ack {:.0}% (sums of call durations over the drain's wall time; batches in flight overlap)",
        s.median_of(|r| r.claim_share) * 100.0,
        s.median_of(|r| r.publish_share) * 100.0,
        s.median_of(|r| r.ack_share) * 100.0,
    );
    let retried: u64 = s.runs.iter().map(|r| r.retried).sum();
    let dup: u64 = s.runs.iter().filter_map(|r| r.destination_duplicates).sum();
    println!(
        "  checked: PostgreSQL {} all {}{}; relay retried {retried}{}",
        if args.delete_on_ack || s.relay == RelayKind::Naive {
            "no longer holds"
        } else {
            "marks delivered"
        },
        args.events,
        if kind == SinkKind::Channel {
            String::new()
        } else {
            format!(", the destination held ≥ {} in every run", args.events)
        },
        if dup > 0 {
            format!(", {dup} duplicate requests")
        } else {
            String::new()
        },
    );
    println!(
        "  (backlog written with enqueue_batch of 5000 per transaction at {:.0} events/s)",
        s.median_of(|r| r.enqueue_events_per_second)
    );
    println!();
}

pub(crate) fn summary_json(args: &DrainArgs, s: &SinkSummary) -> serde_json::Value {
    serde_json::json!({
        "scenario": "drain", "sink": s.kind.name(), "relay": s.relay.name(), "destination": s.detail,
        "sink_config": s.sink_config,
        "events": args.events, "aggregates": args.aggregates, "payload_bytes": args.payload_bytes,
        "batch_size": args.batch_size, "batches_in_flight": args.batches_in_flight,
        "delete_on_ack": args.delete_on_ack, "runs": args.runs, "database": s.settings,
        "target_events_per_second": s.kind.target(),
        "events_per_second_median": s.median_of(|r| r.events_per_second),
        "relay_cpu_seconds_per_10k_median": s.median_of(|r| r.relay_cpu_us_per_event) / 100.0,
        "relay_cpu_us_per_event_median": s.median_of(|r| r.relay_cpu_us_per_event),
        "relay_peak_rss_mb_median": s.median_of(|r| r.relay_peak_rss_mb),
        "publish_call_ms_p50_median": s.median_of(|r| r.publish_call_ms.p50_ms),
        "publish_call_ms_p99_median": s.median_of(|r| r.publish_call_ms.p99_ms),
        "publish_call_ms_max_median": s.median_of(|r| r.publish_call_ms.max_ms),
        "publish_event_ms_p50_median": s.median_of(|r| r.publish_event_ms.p50_ms),
        "publish_event_ms_p99_median": s.median_of(|r| r.publish_event_ms.p99_ms),
        "events_per_publish_call_median": s.median_of(|r| r.events_per_call),
        "enqueue_events_per_second_median": s.median_of(|r| r.enqueue_events_per_second),
        "per_run": s.runs,
    })
}

/// The workload every run of `drain` gets, as both headers print it.
fn workload(args: &DrainArgs) -> String {
    format!(
        "{} events of {} B over {} aggregates, batch {}, {} batch(es) in flight",
        args.events, args.payload_bytes, args.aggregates, args.batch_size, args.batches_in_flight,
    )
}

pub(crate) fn print_table(args: &DrainArgs, results: &[(SinkKind, Result<SinkSummary, String>)]) {
    println!(
        "drain, every sink: {}, median of {} run(s)",
        workload(args),
        args.runs.max(1)
    );
    println!(
        "{:<9} {:>9} {:>8} {:>9} {:>7} {:>11} {:>11} {:>11}  {:<17}",
        "sink",
        "events/s",
        "target",
        "µs/event",
        "RSS MB",
        "call p50 ms",
        "call p99 ms",
        "event p99",
        "claim/pub/ack %"
    );
    for (kind, result) in results {
        let target = kind
            .target()
            .map(|t| format!("{t:.0}"))
            .unwrap_or_else(|| "-".into());
        match result {
            Ok(s) => {
                let rate = s.median_of(|r| r.events_per_second);
                let mark = match kind.target() {
                    Some(t) if rate < t => "↓",
                    Some(_) => "✓",
                    None => " ",
                };
                println!(
                    "{:<9} {:>8.0}{mark} {:>8} {:>9.1} {:>7.1} {:>11.2} {:>11.2} {:>11.2}  {:.0}/{:.0}/{:.0}",
                    kind.name(),
                    rate,
                    target,
                    s.median_of(|r| r.relay_cpu_us_per_event),
                    s.median_of(|r| r.relay_peak_rss_mb),
                    s.median_of(|r| r.publish_call_ms.p50_ms),
                    s.median_of(|r| r.publish_call_ms.p99_ms),
                    s.median_of(|r| r.publish_event_ms.p99_ms),
                    s.median_of(|r| r.claim_share) * 100.0,
                    s.median_of(|r| r.publish_share) * 100.0,
                    s.median_of(|r| r.ack_share) * 100.0,
                );
            }
            Err(error) => {
                let short: String = error.chars().take(90).collect();
                println!("{:<9} FAILED: {short}", kind.name());
            }
        }
    }
    println!(
        "(✓/↓: at or below issue 3's target; figures from a busy machine mean nothing. Latency: one publish call = one wave of at most one event per aggregate.)"
    );
}
