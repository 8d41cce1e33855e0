//! A throwaway PostgreSQL cluster the harness owns, so it can restart it (cleanly or as a
//! crash) in the middle of a run. The machine's shared server is never restarted.
//!
//! Set up like `scripts/pg-logical.sh` does: `initdb` (as the `postgres` OS user when the
//! harness runs as root, since initdb refuses root), trust authentication, listening on
//! 127.0.0.1 on a port of its own and on a unix socket inside its data directory,
//! `wal_level = logical` so WAL mode can run against the same cluster.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;

use crate::Error;

/// Where the PostgreSQL 15 programs live unless `OUTBOX_VERIFY_PGBIN` says otherwise.
pub const DEFAULT_PGBIN: &str = "/usr/lib/postgresql/15/bin";

/// A PostgreSQL cluster in a directory of the harness's work directory.
#[derive(Debug)]
pub struct PgCluster {
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
}

fn running_as_root() -> bool {
    // `id -u` avoids unsafe libc calls for one number.
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A command that runs as `postgres` when we are root.
fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// A TCP port nobody listens on right now.
pub fn free_port() -> Result<u16, Error> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(Error::io("finding a free port"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(Error::io("finding a free port"))
}

async fn run(mut command: Command, what: &str) -> Result<String, Error> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(Error::io(what.to_owned()))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(Error::Process(format!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )))
    }
}

impl PgCluster {
    /// Create a cluster in `dir` (which must not exist yet) listening on `port`, and start it.
    pub async fn create(dir: &Path, port: u16) -> Result<Self, Error> {
        let bin = std::env::var_os("OUTBOX_VERIFY_PGBIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PGBIN));
        if !bin.join("initdb").exists() {
            return Err(Error::Process(format!(
                "{} not found: install postgresql-15, set OUTBOX_VERIFY_PGBIN, or pass --database-url to use an existing server (the database-restart fault is then skipped)",
                bin.join("initdb").display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
        if running_as_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres:postgres").arg(dir);
                    c
                },
                "chown of the cluster directory",
            )
            .await?;
        }
        set_mode(dir, 0o700)?;
        let mut initdb = as_postgres(&bin.join("initdb"));
        initdb.arg("-D").arg(dir).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        ]);
        run(initdb, "initdb").await?;
        let conf = format!(
            "\n# outbox-verify throwaway cluster\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\nwal_level = logical\nmax_replication_slots = 10\nmax_wal_senders = 10\nmax_connections = 300\nwal_sender_timeout = 5s\nlog_min_messages = warning\n",
            dir.display()
        );
        let conf_path = dir.join("postgresql.conf");
        let mut text = tokio::fs::read_to_string(&conf_path)
            .await
            .map_err(Error::io("reading postgresql.conf"))?;
        text.push_str(&conf);
        // Written as root, read by postgres: the file keeps its owner when overwritten.
        tokio::fs::write(&conf_path, text)
            .await
            .map_err(Error::io("writing postgresql.conf"))?;
        let cluster = PgCluster {
            dir: dir.to_path_buf(),
            port,
            bin,
        };
        cluster.start().await?;
        Ok(cluster)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Start the server and wait until it accepts connections.
    pub async fn start(&self) -> Result<(), Error> {
        let mut c = as_postgres(&self.bin.join("pg_ctl"));
        c.arg("-D")
            .arg(&self.dir)
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .args(["-w", "-t", "60", "start"])
            .stdout(Stdio::null());
        run(c, "pg_ctl start").await?;
        Ok(())
    }

    /// Stop the server: `fast` (clean shutdown, open transactions rolled back) or `immediate`
    /// (no shutdown checkpoint: the next start runs crash recovery, as after a power cut).
    pub async fn stop(&self, immediate: bool) -> Result<(), Error> {
        let mut c = as_postgres(&self.bin.join("pg_ctl"));
        c.arg("-D")
            .arg(&self.dir)
            .args(["-m", if immediate { "immediate" } else { "fast" }])
            .args(["-w", "-t", "60", "stop"]);
        run(c, "pg_ctl stop").await?;
        Ok(())
    }

    /// Stop, stay down for `down`, start again.
    pub async fn restart(&self, immediate: bool, down: Duration) -> Result<(), Error> {
        self.stop(immediate).await?;
        tokio::time::sleep(down).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.start().await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Whether it answers.
    pub async fn is_up(&self) -> bool {
        let mut c = Command::new(self.bin.join("pg_isready"));
        c.args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()]);
        run(c, "pg_isready").await.is_ok()
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        // Best effort, synchronously: a harness that ends (or panics) must not leave a server
        // behind on the machine.
        let mut c = if running_as_root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"])
                .arg(self.bin.join("pg_ctl"));
            c
        } else {
            std::process::Command::new(self.bin.join("pg_ctl"))
        };
        let _ = c
            .arg("-D")
            .arg(&self.dir)
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// chmod.
pub fn set_mode(path: &Path, mode: u32) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(Error::io(format!("chmod {}", path.display())))
}
