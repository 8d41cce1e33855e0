//! Phase 1, setup: the work directory, the outbox's database behind two proxies, the
//! destinations, the writers' tables, the consumers and the relay processes.
//!
//! Why its own module: everything a run needs before the first write, each part built by one
//! function, so the run itself reads as its phases.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use outbox_postgresql::PgOutbox;
use outbox_testkit::TcpProxy;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Options;
use crate::Error;
use crate::cluster::PgCluster;
use crate::dest::file::FileDestination;
use crate::dest::webhook::WebhookDestination;
use crate::dest::{ConsumerSide, Destination};
use crate::relays::Relays;
use crate::writers::{self, WriterOptions};

/// Names of the run's tables (unique per run, so runs against a shared database do not meet).
pub(super) struct Names {
    pub(super) outbox_schema: String,
    pub(super) business_schema: String,
    pub(super) consumer_schema: String,
}

impl Names {
    fn new(owned: bool) -> Self {
        let tag = format!(
            "{}_{}",
            std::process::id(),
            rand::random::<u32>() % 1_000_000
        );
        Names {
            outbox_schema: if owned {
                "outbox".into()
            } else {
                format!("outbox_t_v{tag}")
            },
            business_schema: if owned {
                "outbox_t_verify".into()
            } else {
                format!("outbox_t_vb{tag}")
            },
            consumer_schema: format!("outbox_t_vc{tag}"),
        }
    }
}

/// The run's directory and, in it, the relays' log directory.
pub(super) fn work_dirs(options: &Options) -> Result<(PathBuf, PathBuf), Error> {
    let work = options.work_dir.clone();
    std::fs::create_dir_all(&work).map_err(Error::io(format!("creating {}", work.display())))?;
    // The cluster runs as `postgres`, which must be able to reach its directory.
    crate::cluster::set_mode(&work, 0o755)?;
    let logs = work.join("relay-logs");
    std::fs::create_dir_all(&logs).map_err(Error::io("creating the log directory"))?;
    Ok((work, logs))
}

/// The outbox's database: a throwaway cluster (or the given database), migrated.
pub(super) struct Database {
    pub(super) cluster: Option<Arc<PgCluster>>,
    pub(super) url: String,
    pub(super) names: Names,
    pub(super) admin: PgPool,
    pub(super) outbox: PgOutbox,
}

/// The proxies in front of the database: one for the relays' links, one for the writers'.
pub(super) struct Links {
    pub(super) relay_db: TcpProxy,
    pub(super) writer_db: TcpProxy,
}

/// The outbox's database, migrated, and the proxies in front of it.
pub(super) async fn database(options: &Options, work: &Path) -> Result<(Database, Links), Error> {
    if options.mode != "poll" && options.mode != "wal" {
        return Err(Error::Invalid(format!(
            "unknown mode `{}` (poll or wal)",
            options.mode
        )));
    }
    let (cluster, url) = match &options.database_url {
        Some(url) => (None, url.clone()),
        None => {
            let port = crate::cluster::free_port()?;
            let cluster = PgCluster::create(&work.join("pg"), port).await?;
            let admin = admin_pool(&cluster.url("postgres")).await?;
            sqlx::query("CREATE DATABASE outbox_verify")
                .execute(&admin)
                .await?;
            admin.close().await;
            let url = cluster.url("outbox_verify");
            (Some(Arc::new(cluster)), url)
        }
    };
    let names = Names::new(cluster.is_some());
    let admin = admin_pool(&url).await?;
    let outbox = PgOutbox::with_names(&names.outbox_schema, "events")?;
    outbox.migrate(&admin).await?;
    let upstream = upstream_of(&url)?;
    let relay_db = TcpProxy::start(upstream)
        .await
        .map_err(Error::io("starting the relay database proxy"))?;
    let writer_db = TcpProxy::start(upstream)
        .await
        .map_err(Error::io("starting the writer database proxy"))?;
    Ok((
        Database {
            cluster,
            url,
            names,
            admin,
            outbox,
        },
        Links {
            relay_db,
            writer_db,
        },
    ))
}

/// The destinations named in the options, each with its broker started.
pub(super) async fn destinations(
    options: &Options,
    work: &Path,
) -> Result<Vec<Arc<dyn Destination>>, Error> {
    let mut dests: Vec<Arc<dyn Destination>> = Vec::new();
    for name in &options.destinations {
        let d: Arc<dyn Destination> = match name.as_str() {
            "file" => Arc::new(FileDestination::new("file", work.join("sink.jsonl"))?),
            "webhook" => Arc::new(WebhookDestination::start("webhook").await?),
            #[cfg(feature = "nats")]
            "nats" => Arc::new(
                crate::dest::nats::NatsDestination::start("nats", work.join("nats")).await?,
            ),
            #[cfg(feature = "kafka")]
            "kafka" => Arc::new(
                crate::dest::kafka::KafkaDestination::start("kafka", work.to_path_buf()).await?,
            ),
            other => {
                return Err(Error::Invalid(format!(
                    "unknown destination `{other}` (known: file, nats, kafka, webhook)"
                )));
            }
        };
        dests.push(d);
    }
    if dests.is_empty() {
        return Err(Error::Invalid("no destination".into()));
    }
    Ok(dests)
}

/// What the writers share, with the business tables created.
pub(super) async fn writers(
    options: &Options,
    db: &Database,
    links: &Links,
    dests: &[Arc<dyn Destination>],
) -> Result<Arc<WriterOptions>, Error> {
    let writer_options = Arc::new(WriterOptions {
        url: via(&db.url, &links.writer_db, "outbox_verify_writer")?,
        rate: options.rate,
        rollback: options.rollback,
        crash: options.crash,
        max_events: 3,
        aggregates: options.aggregates,
        destinations: dests.iter().map(|d| d.name().to_owned()).collect(),
        pad: options.pad,
        outbox: db.outbox.clone(),
        schema: db.names.business_schema.clone(),
    });
    let mut conn = writers::connect(&db.url).await?;
    writers::setup(&mut conn, &writer_options).await?;
    Ok(writer_options)
}

/// The consumer side: its inbox and effects tables and one consumer task per destination.
pub(super) struct Consumers {
    pub(super) pool: PgPool,
    pub(super) side: Arc<ConsumerSide>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) tasks: Vec<JoinHandle<()>>,
}

pub(super) async fn consumers(
    options: &Options,
    names: &Names,
    dests: &[Arc<dyn Destination>],
) -> Result<Consumers, Error> {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&options.consumer_url)
        .await?;
    let side = Arc::new(
        ConsumerSide::setup(pool.clone(), &names.consumer_schema, options.consumer_crash).await?,
    );
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for d in dests {
        tasks.push(
            d.start_consumer(side.handler(d.name()), stopped.clone())
                .await?,
        );
    }
    Ok(Consumers {
        pool,
        side,
        stop,
        tasks,
    })
}

/// The relay processes, started.
pub(super) async fn relays(
    options: &Options,
    config_path: &Path,
    logs: &Path,
) -> Result<Arc<Relays>, Error> {
    let mut relays = Relays::new(
        options.outbox_bin.clone(),
        config_path.to_path_buf(),
        logs.to_path_buf(),
        options.relays,
    );
    relays.per_relay_env = options.per_relay_env.clone();
    let relays = Arc::new(relays);
    relays.start_all().await?;
    Ok(relays)
}

pub(super) async fn admin_pool(url: &str) -> Result<PgPool, Error> {
    let options: PgConnectOptions = url.parse()?;
    Ok(PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.application_name("outbox_verify_admin"))
        .await?)
}

/// `postgres://…/db` with `application_name` set, through `proxy`.
pub(super) fn via(url: &str, proxy: &TcpProxy, app: &str) -> Result<String, Error> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::Invalid(format!("not a URL: {url}")));
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let userinfo = authority
        .rsplit_once('@')
        .map(|(u, _)| format!("{u}@"))
        .unwrap_or_default();
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let query = if query.is_empty() {
        format!("application_name={app}")
    } else {
        format!("{query}&application_name={app}")
    };
    Ok(format!(
        "{scheme}://{userinfo}{}/{path}?{query}",
        proxy.addr()
    ))
}

fn upstream_of(url: &str) -> Result<std::net::SocketAddr, Error> {
    let options: PgConnectOptions = url.parse()?;
    let host = options.get_host();
    let host = if host.starts_with('/') || host == "localhost" {
        "127.0.0.1"
    } else {
        host
    };
    use std::net::ToSocketAddrs;
    (host, options.get_port())
        .to_socket_addrs()
        .map_err(Error::io("resolving the database address"))?
        .next()
        .ok_or_else(|| Error::Invalid(format!("cannot resolve {host}")))
}
