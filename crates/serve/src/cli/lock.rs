//! `broker lock` (the report) and `broker lock run` (hold the lock around a program).

use super::UsageError;
use anyhow::{Context, Result};
use broker_capabilities::machine_lock::{LockError, MachineLock, Spec};
use broker_core::broker::service::machine_lock;
use clap::{Args, Subcommand};
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct LockArgs {
    #[command(subcommand)]
    command: Option<LockCommand>,
    /// Use the group lock `machine-lock-<GROUP>` instead of `machine-lock`.
    #[arg(long, global = true)]
    group: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// How many history lines to show.
    #[arg(long, default_value_t = 20)]
    history: usize,
}

#[derive(Debug, Subcommand)]
enum LockCommand {
    /// Hold the machine lock while PROGRAM runs (like flock(1)), so scripts and other
    /// agents serialise with the host. Exits with the program's status, or 1 if the
    /// lock could not be taken.
    Run {
        /// Who holds the lock, as reports and history show it.
        #[arg(long)]
        worker: String,
        #[arg(long, default_value = "")]
        comment: String,
        /// Give up after this long, e.g. 5s or 2m; 0 waits forever.
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// The program and its arguments, passed verbatim (no shell).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
        program: Vec<String>,
    },
}

fn open(data_dir: &Path, group: Option<&str>) -> Result<MachineLock> {
    let lock = match group {
        None => machine_lock(data_dir),
        Some(group) => MachineLock::new(data_dir, &format!("machine-lock-{group}"), "broker"),
    };
    lock.map_err(|e| UsageError(e.to_string()).into())
}

/// Returns the process exit code.
pub(crate) async fn run(data_dir: &Path, args: LockArgs, out: &mut impl Write) -> Result<u8> {
    let lock = open(data_dir, args.group.as_deref())?;
    match args.command {
        None => {
            let report = lock.report(args.history);
            if args.json {
                writeln!(out, "{}", super::output::json_pretty(&report)?)?;
            } else {
                write!(out, "{}", report.text())?;
            }
            Ok(0)
        }
        Some(LockCommand::Run { worker, comment, timeout, program }) => {
            let abort = Arc::new(AtomicBool::new(false));
            let on_interrupt = abort.clone();
            tokio::spawn(async move {
                if tokio::signal::ctrl_c().await.is_ok() {
                    on_interrupt.store(true, Ordering::SeqCst);
                }
            });
            let spec = Spec { worker, comment, timeout: Some(timeout), abort: Some(abort) };
            let mut guard = match lock.acquire(spec).await {
                // A worker or comment the lock refuses is how the command was called.
                Err(e @ LockError::InvalidSpec(_)) => return Err(UsageError(e.to_string()).into()),
                acquired => acquired.context("cannot take the machine lock")?,
            };
            let (name, args) = program.split_first().expect("clap requires PROGRAM");
            let mut command = std::process::Command::new(name);
            command.args(args);
            let status = tokio::task::spawn_blocking(move || command.status())
                .await
                .context("waiting for the program")?
                .with_context(|| format!("cannot run {name}"));
            guard.release();
            let status = status?;
            Ok(match (status.code(), status.signal()) {
                (Some(code), _) => code as u8,
                (None, Some(signal)) => 128u8.saturating_add(signal as u8),
                (None, None) => 1,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_worker_with_a_newline_is_a_usage_error_and_runs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        let run_args = |worker: &str| LockArgs {
            command: Some(LockCommand::Run {
                worker: worker.into(),
                comment: "c".into(),
                timeout: std::time::Duration::ZERO,
                program: vec!["touch".into(), marker.display().to_string()],
            }),
            group: None,
            json: false,
            history: 20,
        };
        let err = run(dir.path(), run_args("w\nforged"), &mut Vec::new()).await.unwrap_err();
        let usage = err.downcast_ref::<UsageError>().map(|e| e.0.clone()).unwrap_or_default();
        assert!(usage.contains("worker must be printable"), "{err:#}");
        assert!(!marker.exists(), "the program must not run");
        assert_eq!(run(dir.path(), run_args("w"), &mut Vec::new()).await.unwrap(), 0);
        assert!(marker.exists());
    }
}
