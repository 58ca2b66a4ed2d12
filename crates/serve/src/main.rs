//! The `broker` command (see `broker --help`).

fn main() -> std::process::ExitCode {
    broker_serve::cli::main()
}
