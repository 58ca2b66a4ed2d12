use broker_host::cli::{Cli, UsageError, run};
use broker_host::error_text::{chain_text, escape_unprintable};
use clap::Parser;
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // clap exits with 2 on usage errors and 0 for --help/--version.
    let cli = Cli::parse();
    let default_level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level)))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) if e.downcast_ref::<UsageError>().is_some() => {
            eprintln!("error: {}\n(see `broker --help`)", escape_unprintable(&chain_text(e.chain())));
            ExitCode::from(2)
        }
        Err(e) => {
            // Errors quote what providers said: escaped, they cannot drive the terminal.
            eprintln!("error: {}", escape_unprintable(&chain_text(e.chain())));
            ExitCode::from(1)
        }
    }
}
