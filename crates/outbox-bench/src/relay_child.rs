//! The hidden `relay-child` command: the relay under measurement, in a process of its own so
//! its CPU time and peak RSS are its own; it reports its figures as one JSON line.

use super::*;

pub(crate) async fn relay_child(url: &str, args: ChildArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OUTBOX_BENCH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let pg = Arc::new(
        PgStore::connect(url, PgOutbox::with_names(&args.schema, "events")?)
            .await?
            .with_delete_on_ack(args.delete_on_ack),
    );
    let store = Arc::new(TimedSource::new(pg.clone()));
    let (inner, consumer) = child_sink(&args).await?;
    // Connection set-up happens before the clock starts: it is not what a drain measures.
    let connect_seconds = wait_until_ready(inner.as_ref(), args.sink).await?;
    let stamp = args
        .record_acks
        .as_ref()
        .map(|_| Arc::new(load::AckStampSink::new(inner.clone())));
    let stamped: Arc<dyn Sink> = match &stamp {
        Some(s) => s.clone(),
        None => inner,
    };
    let sink = Arc::new(TimedSink::new(stamped));
    // Steady state: the parent closes our standard input when its writers are done and the
    // outbox is drained. Otherwise the relay stops on its own when nothing is left.
    let until_eof = args.until_stdin_eof;
    let shutdown = async move {
        if until_eof {
            use tokio::io::AsyncReadExt;
            let mut sink = Vec::new();
            let _ = tokio::io::stdin().read_to_end(&mut sink).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    // The parent starts its writers once this line arrives.
    println!("READY");

    let config = child_config(&args, until_eof);
    let cpu_before = cpu_snapshot();
    let cpu_ticks_before = cpu_ticks_seconds()?;
    let started = Instant::now();
    let report = match args.relay {
        RelayKind::Ours => {
            let relay = Relay::new(store.clone(), sink.clone(), config);
            relay.run(shutdown).await
        }
        RelayKind::Naive => {
            let naive = naive::run(
                &pg,
                sink.clone(),
                (!until_eof).then_some(args.expect),
                Duration::from_millis(args.idle_sleep_ms),
                shutdown,
            )
            .await?;
            outbox_engine::RelayReport {
                delivered: naive.delivered,
                retried: naive.failed,
                batches: naive.passes,
                ..Default::default()
            }
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds_since(&cpu_before, cpu_ticks_before)?;
    if let Some(consumer) = consumer {
        consumer.abort();
    }
    if let (Some(stamp), Some(path)) = (&stamp, &args.record_acks) {
        stamp.write_to(path)?;
    }
    if !until_eof && report.delivered < args.expect {
        eprintln!(
            "relay child: delivered {} of {} ({report:?})",
            report.delivered, args.expect
        );
    }
    let out = ChildReport {
        delivered: report.delivered,
        seconds,
        cpu_seconds: cpu,
        peak_rss_kb: peak_rss_kb()?,
        connect_seconds,
        relay: RelayCounts {
            batches: report.batches,
            claimed: report.claimed,
            retried: report.retried,
            dead: report.dead,
            released: report.released,
            fenced: report.fenced,
            store_errors: report.store_errors,
        },
        publish: sink.stats(),
        store: store.stats(),
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// The sink under measurement: an in-process channel (with a task counting what it receives)
/// or a real destination.
async fn child_sink(
    args: &ChildArgs,
) -> anyhow::Result<(Arc<dyn Sink>, Option<tokio::task::JoinHandle<u64>>)> {
    let mut consumer = None;
    let inner: Arc<dyn Sink> = match args.sink {
        SinkKind::Channel => {
            let (sink, mut rx) =
                outbox_sink_channel::ChannelSink::new(args.batch_size as usize * 4);
            consumer = Some(tokio::spawn(async move {
                let mut n = 0u64;
                while rx.recv().await.is_some() {
                    n += 1;
                }
                n
            }));
            Arc::new(sink)
        }
        kind => destination::build_sink(kind, &args.sink_config).await?,
    };
    Ok((inner, consumer))
}

/// Checks the sink until it answers (at most 15 s); the seconds that took.
async fn wait_until_ready(inner: &dyn Sink, kind: SinkKind) -> anyhow::Result<f64> {
    let connect_started = Instant::now();
    let mut last_error = None;
    while connect_started.elapsed() < Duration::from_secs(15) {
        match inner.check().await {
            Ok(()) => {
                last_error = None;
                break;
            }
            Err(e) => {
                last_error = Some(e.to_string());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    if let Some(error) = last_error {
        bail!("the {} sink is not ready: {error}", kind);
    }
    Ok(connect_started.elapsed().as_secs_f64())
}

/// The relay's settings under measurement: the defaults but for what the parent passed.
fn child_config(args: &ChildArgs, until_eof: bool) -> RelayConfig {
    RelayConfig {
        relay_id: "bench".into(),
        batch_size: args.batch_size,
        max_batches_in_flight: args.batches_in_flight,
        poll_interval: args
            .poll_interval_ms
            .map(Duration::from_millis)
            .unwrap_or(RelayConfig::default().poll_interval),
        min_poll_interval: args
            .min_poll_interval_ms
            .map(Duration::from_millis)
            .unwrap_or(RelayConfig::default().min_poll_interval),
        dead_letter: DeadLetterPolicy::Block,
        stop_when_idle: !until_eof,
        ..RelayConfig::default()
    }
}
