//! A QMP client over the host's `local-socket`.

use broker_guest::local_socket::{self, Connection};
use broker_guest::process::{Child, ChildStatus};
use broker_guest::types::BrokerError;
use kvm_logic::qmp::{self, Reply};
use serde_json::Value;
use std::time::{Duration, Instant};

/// How long one QMP answer may take.
const REPLY_TIMEOUT_MS: u64 = 5_000;

pub struct Qmp {
    connection: Connection,
}

impl Qmp {
    /// Connect and leave capabilities negotiation, waiting up to `wait` for
    /// qemu to create its socket; fails at once if `child` ends meanwhile.
    pub fn connect(path: &str, child: &Child, wait: Duration) -> Result<Qmp, BrokerError> {
        let until = Instant::now() + wait;
        let connection = loop {
            match local_socket::connect(path) {
                Ok(connection) => break connection,
                // Not there yet, or bound and not yet listening: qemu is still starting.
                Err(BrokerError::NotFound(_)) if Instant::now() < until => {
                    if !matches!(child.status(), ChildStatus::Running) {
                        return Err(BrokerError::Provider(format!(
                            "qemu ended before its QMP socket appeared: {:?}",
                            child.status()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(err) => return Err(err),
            }
        };
        let mut qmp = Qmp { connection };
        match qmp.next()? {
            Reply::Greeting => {}
            other => return Err(BrokerError::Provider(format!("QMP did not greet: {other:?}"))),
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn next(&mut self) -> Result<Reply, BrokerError> {
        match self.connection.receive_line(REPLY_TIMEOUT_MS)? {
            Some(line) => qmp::parse(&line).map_err(BrokerError::Provider),
            None => Err(BrokerError::Provider("QMP closed the connection".into())),
        }
    }

    /// Run a command and return its `return` value; events in between are skipped.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, BrokerError> {
        self.connection.send(&qmp::command(command, arguments))?;
        loop {
            match self.next()? {
                Reply::Return(value) => return Ok(value),
                Reply::Error { class, desc } => {
                    return Err(BrokerError::Provider(format!("QMP {command}: {class}: {desc}")));
                }
                Reply::Event(_) | Reply::Greeting => {}
            }
        }
    }
}
