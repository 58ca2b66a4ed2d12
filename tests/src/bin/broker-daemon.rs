//! The `broker` command, built as a binary of this package: the tests here
//! run it as a daemon (and SIGKILL it) without depending on another
//! package's build having made `broker`.

fn main() -> std::process::ExitCode {
    broker_serve::cli::main()
}
