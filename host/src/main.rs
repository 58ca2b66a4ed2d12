//! The `broker` command (see `broker --help`).

fn main() -> std::process::ExitCode {
    broker_host::cli::main()
}
