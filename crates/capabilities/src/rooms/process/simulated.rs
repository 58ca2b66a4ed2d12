//! A simulated process table for the conformance kit: programs a provider
//! runs answer from a script (in order, like a recording), spawned children
//! have a lifecycle (running until signalled, or until a scripted line ends
//! them), and a child serves the unix sockets its arguments name, answering
//! each line it is sent from its script. Nothing real is run.
//!
//! The grant is checked before any of this is reached, exactly as on a real host.

use super::backend::{Launch, ProcessBackend};
use super::children::{ChildRecord, Liveness, RecordsError};
use crate::bindings::BrokerError;
use crate::bindings::broker::provider::process::Output;
use crate::rooms::local_socket::{Connection, SocketAt, SocketBackend, SocketError};
use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

/// Pids of simulated children start here, beyond any real pid (`pid_max` ≤ 2^22).
const FIRST_SIMULATED_PID: u32 = 1 << 23;

/// One run of a program and what it did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ScriptedRun {
    /// As the provider asked for it (its granted name).
    pub program: String,
    /// As the provider wrote them (`/data/...`, not the host's paths).
    pub args: Vec<String>,
    /// `None` when a signal ended it; 0 unless the script says otherwise.
    #[serde(default = "exited_zero")]
    pub exit_code: Option<i32>,
    /// The signal that ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// As text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stdout: String,
    /// As text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stderr: String,
    /// It ran out of its timeout and was killed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
}

fn exited_zero() -> Option<i32> {
    Some(0)
}

impl ScriptedRun {
    pub(crate) fn call(&self) -> String {
        call_text(&self.program, &self.args)
    }
}

fn call_text(program: &str, args: &[String]) -> String {
    std::iter::once(program).chain(args.iter().map(String::as_str)).collect::<Vec<_>>().join(" ")
}

/// A spawned child (a VM's qemu): what it says on its sockets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ScriptedChild {
    /// The granted name it is spawned as.
    pub program: String,
    /// Lines written first on every connection (QMP's greeting).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub greeting: Vec<String>,
    /// Its answers, by the line they answer: the n-th time a line is sent it
    /// gets the n-th answer scripted for that line (the last one repeats).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<Answer>,
    /// It ends by itself with this code before it answers anything (a qemu
    /// that cannot start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<i32>,
}

/// A child's scripted reply to one line it is sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Answer {
    /// The line as sent, without its line end.
    pub line: String,
    /// Lines written back, in order.
    #[serde(default)]
    pub reply: Vec<String>,
    /// The child exits with this code after replying (QMP `quit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<i32>,
}

struct SimChild {
    record: ChildRecord,
    script: ScriptedChild,
    /// Its arguments as the provider wrote them: the sockets it serves are named there.
    guest_args: Vec<String>,
    state: Liveness,
    /// How often each line was sent to it.
    asked: HashMap<String, usize>,
}

#[derive(Default)]
struct Table {
    runs: VecDeque<ScriptedRun>,
    spawns: VecDeque<ScriptedChild>,
    children: BTreeMap<(String, String), SimChild>,
    spawned: u32,
}

/// The simulated programs and children of one kit run.
#[derive(Default)]
pub(crate) struct SimProcesses {
    table: Mutex<Table>,
    unexpected: Mutex<Vec<String>>,
}

impl SimProcesses {
    /// Runs are answered in order; each spawn takes the next scripted child of its program.
    pub(crate) fn new(runs: Vec<ScriptedRun>, children: Vec<ScriptedChild>) -> SimProcesses {
        let table = Table { runs: runs.into(), spawns: children.into(), ..Table::default() };
        SimProcesses { table: Mutex::new(table), unexpected: Mutex::default() }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note_unexpected(&self, message: &str) {
        self.unexpected.lock().unwrap_or_else(|p| p.into_inner()).push(message.to_owned());
    }

    fn unscripted(&self, message: String) -> BrokerError {
        self.note_unexpected(&message);
        BrokerError::Provider(message)
    }

    /// Host calls the script had no answer for since the last call.
    pub(crate) fn take_unexpected(&self) -> Vec<String> {
        std::mem::take(&mut *self.unexpected.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Scripted runs and children nobody asked for (yet).
    pub(crate) fn remaining(&self) -> usize {
        let table = self.lock();
        table.runs.len() + table.spawns.len()
    }

    pub(crate) fn run(&self, program: &str, args: &[String]) -> Result<Output, BrokerError> {
        let mut table = self.lock();
        let next = table.runs.front().is_some_and(|r| r.program == program && r.args == args);
        if next && let Some(run) = table.runs.pop_front() {
            return Ok(Output {
                exit_code: run.exit_code,
                signal: run.signal,
                stdout: run.stdout.into_bytes(),
                stderr: run.stderr.into_bytes(),
                truncated: false,
                timed_out: run.timed_out,
            });
        }
        let expected = match table.runs.front() {
            Some(next) => format!("the script's next run is {}", next.call()),
            None => "the script has no more runs".to_owned(),
        };
        drop(table);
        Err(self.unscripted(format!("unscripted run {} ({expected})", call_text(program, args))))
    }

    pub(crate) fn spawn(
        &self,
        provider: &str,
        name: &str,
        program: &str,
        args: &[String],
    ) -> Result<ChildRecord, BrokerError> {
        let mut table = self.lock();
        let key = (provider.to_owned(), name.to_owned());
        if table.children.get(&key).is_some_and(|c| c.state == Liveness::Running) {
            return Err(BrokerError::InvalidParams(format!("a child named {name:?} is still running")));
        }
        let next = table.spawns.iter().position(|c| c.program == program);
        let Some(script) = next.and_then(|at| table.spawns.remove(at)) else {
            drop(table);
            let call = call_text(program, args);
            return Err(self.unscripted(format!("unscripted spawn {call} (no scripted child of {program} is left)")));
        };
        table.spawned += 1;
        let record = ChildRecord {
            provider: provider.to_owned(),
            name: name.to_owned(),
            pid: FIRST_SIMULATED_PID + table.spawned,
            start_time: 0,
            program: program.to_owned(),
            args: args.to_vec(),
            log: format!("/data/logs/{name}.log"),
            sandbox: None,
        };
        let state = script.exit.map_or(Liveness::Running, Liveness::Exited);
        let child =
            SimChild { record: record.clone(), script, guest_args: args.to_vec(), state, asked: HashMap::new() };
        table.children.insert(key, child);
        Ok(record)
    }

    /// The child spawned under `name`, until it is forgotten.
    pub(crate) fn adopt(&self, provider: &str, name: &str) -> Option<ChildRecord> {
        let table = self.lock();
        table.children.get(&(provider.to_owned(), name.to_owned())).map(|c| c.record.clone())
    }

    pub(crate) fn children(&self, provider: &str) -> Vec<String> {
        self.lock().children.keys().filter(|(p, _)| p == provider).map(|(_, name)| name.clone()).collect()
    }

    pub(crate) fn liveness(&self, record: &ChildRecord) -> Liveness {
        self.liveness_of(&(record.provider.clone(), record.name.clone()))
    }

    fn liveness_of(&self, key: &(String, String)) -> Liveness {
        self.lock().children.get(key).map_or(Liveness::Gone, |c| c.state)
    }

    /// Any signal ends a simulated child: it is killed by it.
    pub(crate) fn signal(&self, record: &ChildRecord, signal: i32) -> Result<(), BrokerError> {
        let mut table = self.lock();
        match table.children.get_mut(&(record.provider.clone(), record.name.clone())) {
            Some(child) if child.state == Liveness::Running => {
                child.state = Liveness::Signalled(signal);
                Ok(())
            }
            _ => Err(BrokerError::NotFound(format!("child {:?} is not running", record.name))),
        }
    }

    pub(crate) fn forget(&self, record: &ChildRecord) {
        self.lock().children.remove(&(record.provider.clone(), record.name.clone()));
    }

    /// Connect to a socket a running child of `provider` serves: one whose
    /// arguments name `guest_path`.
    pub(crate) fn connect_to(self: &Arc<Self>, provider: &str, guest_path: &str) -> Result<SimConnection, SocketError> {
        let table = self.lock();
        let mut serving = table
            .children
            .iter()
            .filter(|((p, _), c)| p == provider && c.guest_args.iter().any(|a| names_path(a, guest_path)));
        let Some((key, child)) = serving.find(|(_, c)| c.state == Liveness::Running) else {
            return Err(SocketError::Missing(guest_path.to_owned()));
        };
        Ok(SimConnection {
            table: self.clone(),
            child: key.clone(),
            outbox: child.script.greeting.iter().cloned().collect(),
            partial: String::new(),
            closed: false,
        })
    }
}

/// Programs answer from the script and children are simulated; waiting on one
/// cannot help, since it changes only when the provider acts.
impl ProcessBackend for SimProcesses {
    fn runs_programs(&self) -> bool {
        false
    }

    fn run<'a>(
        &'a self,
        launch: Launch<'a>,
        _stdin: Vec<u8>,
        _timeout_ms: u64,
    ) -> BoxFuture<'a, Result<Output, BrokerError>> {
        Box::pin(async move { SimProcesses::run(self, launch.program, launch.guest_args) })
    }

    fn spawn<'a>(&'a self, launch: Launch<'a>, name: &'a str) -> BoxFuture<'a, Result<ChildRecord, BrokerError>> {
        Box::pin(async move { SimProcesses::spawn(self, launch.provider, name, launch.program, launch.guest_args) })
    }

    fn adopt<'a>(
        &'a self,
        provider: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ChildRecord>, BrokerError>> {
        Box::pin(async move { Ok(SimProcesses::adopt(self, provider, name)) })
    }

    fn liveness(&self, record: &ChildRecord) -> Liveness {
        SimProcesses::liveness(self, record)
    }

    fn wait<'a>(&'a self, record: &'a ChildRecord, _timeout: std::time::Duration) -> BoxFuture<'a, Liveness> {
        Box::pin(async move { SimProcesses::liveness(self, record) })
    }

    fn signal(&self, record: &ChildRecord, signal: nix::sys::signal::Signal) -> Result<(), BrokerError> {
        SimProcesses::signal(self, record, signal as i32)
    }

    fn forget<'a>(&'a self, record: &'a ChildRecord) -> BoxFuture<'a, ()> {
        Box::pin(async move { SimProcesses::forget(self, record) })
    }

    fn children(&self, provider: &str) -> Result<Vec<String>, RecordsError> {
        Ok(SimProcesses::children(self, provider))
    }
}

/// The sockets simulated children serve.
impl SocketBackend for SimProcesses {
    fn connect<'a>(self: Arc<Self>, at: SocketAt<'a>) -> BoxFuture<'a, Result<Box<dyn Connection>, SocketError>> {
        Box::pin(async move {
            let connection = self.connect_to(at.provider, at.guest_path)?;
            Ok(Box::new(connection) as Box<dyn Connection>)
        })
    }
}

/// Whether an argument names `path`: as itself, or as a value in it
/// (`unix:/data/x.qmp,server=on`, `path=/data/x.qmp`).
pub(super) fn names_path(arg: &str, path: &str) -> bool {
    arg.split([',', '=']).any(|part| part == path || part.strip_prefix("unix:") == Some(path))
}

/// A connection to a simulated child's socket.
pub(crate) struct SimConnection {
    table: Arc<SimProcesses>,
    child: (String, String),
    /// Lines the child has written that the provider has not read yet.
    outbox: VecDeque<String>,
    /// A line being sent, not yet ended by a newline.
    partial: String,
    closed: bool,
}

impl SimConnection {
    pub(crate) fn send(&mut self, data: &[u8]) -> Result<(), SocketError> {
        if self.closed {
            return Err(SocketError::Io(std::io::Error::from_raw_os_error(nix::libc::EPIPE)));
        }
        self.partial.push_str(&String::from_utf8_lossy(data));
        while let Some(end) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=end).collect();
            self.answer(line.trim_end_matches(['\n', '\r']));
            if self.closed {
                break;
            }
        }
        Ok(())
    }

    fn answer(&mut self, line: &str) {
        let mut table = self.table.lock();
        let Some(child) = table.children.get_mut(&self.child).filter(|c| c.state == Liveness::Running) else {
            self.closed = true;
            return;
        };
        let asked = child.asked.entry(line.to_owned()).or_default();
        let scripted: Vec<&Answer> = child.script.answers.iter().filter(|a| a.line == line).collect();
        let Some(answer) = scripted.get((*asked).min(scripted.len().saturating_sub(1))).map(|a| (*a).clone()) else {
            let message = format!("unscripted line to {} child {:?}: {line}", child.script.program, child.record.name);
            drop(table);
            // The child hangs up on what it does not understand, so the provider fails at once.
            self.closed = true;
            self.table.note_unexpected(&message);
            return;
        };
        *asked += 1;
        self.outbox.extend(answer.reply);
        if let Some(code) = answer.exit {
            child.state = Liveness::Exited(code);
        }
    }

    /// The next line; `None` once the child hung up or ended. Nothing more can
    /// arrive while the provider waits, so an empty outbox times out at once.
    pub(crate) fn receive_line(&mut self, timeout_ms: u64) -> Result<Option<String>, SocketError> {
        if let Some(line) = self.outbox.pop_front() {
            return Ok(Some(line));
        }
        let running = self.table.liveness_of(&self.child) == Liveness::Running;
        if self.closed || !running { Ok(None) } else { Err(SocketError::Timeout(timeout_ms)) }
    }
}

impl Connection for SimConnection {
    fn send<'a>(&'a mut self, data: &'a [u8]) -> BoxFuture<'a, Result<(), SocketError>> {
        Box::pin(async move { SimConnection::send(self, data) })
    }

    fn receive_line(&mut self, timeout: std::time::Duration) -> BoxFuture<'_, Result<Option<String>, SocketError>> {
        Box::pin(async move { SimConnection::receive_line(self, timeout.as_millis() as u64) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rooms::process::ProcessTape;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    fn qemu_child() -> ScriptedChild {
        let answer = |line: &str, reply: &str, exit| Answer { line: line.into(), reply: vec![reply.into()], exit };
        ScriptedChild {
            program: "qemu".into(),
            greeting: vec!["{\"QMP\":{}}".into()],
            answers: vec![
                answer("status", "running", None),
                answer("status", "paused", None),
                answer("quit", "bye", Some(0)),
            ],
            exit: None,
        }
    }

    #[test]
    fn runs_are_answered_in_order_and_anything_else_is_unscripted() {
        let first = ScriptedRun {
            program: "qemu-img".into(),
            args: strings(&["create", "/data/a"]),
            exit_code: Some(1),
            signal: None,
            stdout: "out".into(),
            stderr: "no space".into(),
            timed_out: false,
        };
        let sim = SimProcesses::new(vec![first.clone()], Vec::new());
        let wrong = sim.run("qemu-img", &strings(&["create", "/data/b"])).unwrap_err();
        assert!(
            matches!(&wrong, BrokerError::Provider(m) if m.contains("unscripted run qemu-img create /data/b (the script's next run is qemu-img create /data/a)")),
            "{wrong:?}"
        );
        let output = sim.run("qemu-img", &first.args).unwrap();
        assert_eq!((output.exit_code, output.stdout, output.stderr), (Some(1), b"out".to_vec(), b"no space".to_vec()));
        assert!(sim.run("qemu-img", &first.args).is_err(), "each run is answered once");
        assert_eq!(sim.take_unexpected().len(), 2);
        assert!(sim.take_unexpected().is_empty());
        assert_eq!(sim.remaining(), 0);
    }

    #[test]
    fn a_child_lives_serves_its_socket_and_ends_by_a_line_or_a_signal() {
        let sim = Arc::new(SimProcesses::new(Vec::new(), vec![qemu_child(), qemu_child()]));
        let args = strings(&["-qmp", "unix:/data/run/1.qmp,server=on,wait=off"]);
        let record = sim.spawn("kvm", "vm1", "qemu", &args).unwrap();
        assert!(record.pid >= FIRST_SIMULATED_PID);
        assert!(sim.spawn("kvm", "vm1", "qemu", &args).is_err(), "the name is taken while it runs");
        assert_eq!(sim.children("kvm"), ["vm1"]);
        assert!(sim.children("other").is_empty());
        assert!(matches!(sim.connect_to("kvm", "/data/run/2.qmp"), Err(SocketError::Missing(_))));
        assert!(matches!(sim.connect_to("other", "/data/run/1.qmp"), Err(SocketError::Missing(_))));

        let mut connection = sim.connect_to("kvm", "/data/run/1.qmp").unwrap();
        assert_eq!(connection.receive_line(5).unwrap().as_deref(), Some("{\"QMP\":{}}"));
        assert!(matches!(connection.receive_line(5), Err(SocketError::Timeout(5))), "nothing more until asked");
        // Two lines in one write, the second in two pieces.
        connection.send(b"status\nsta").unwrap();
        connection.send(b"tus\r\n").unwrap();
        assert_eq!(connection.receive_line(5).unwrap().as_deref(), Some("running"));
        assert_eq!(connection.receive_line(5).unwrap().as_deref(), Some("paused"));
        connection.send(b"status\n").unwrap();
        assert_eq!(connection.receive_line(5).unwrap().as_deref(), Some("paused"), "the last answer repeats");
        connection.send(b"quit\n").unwrap();
        assert_eq!(connection.receive_line(5).unwrap().as_deref(), Some("bye"));
        assert_eq!(connection.receive_line(5).unwrap(), None, "it ended after its answer");
        assert_eq!(sim.liveness(&record), Liveness::Exited(0));
        assert!(matches!(sim.connect_to("kvm", "/data/run/1.qmp"), Err(SocketError::Missing(_))));
        assert!(sim.signal(&record, 15).is_err(), "an ended child takes no signal");
        assert_eq!(sim.adopt("kvm", "vm1"), Some(record.clone()), "ended but not forgotten");
        sim.forget(&record);
        assert_eq!(sim.adopt("kvm", "vm1"), None);

        // The second scripted child: killed, and what it does not understand hangs up.
        let record = sim.spawn("kvm", "vm1", "qemu", &args).unwrap();
        let mut connection = sim.connect_to("kvm", "/data/run/1.qmp").unwrap();
        connection.receive_line(5).unwrap();
        connection.send(b"reboot\n").unwrap();
        assert_eq!(connection.receive_line(5).unwrap(), None);
        assert!(connection.send(b"status\n").is_err(), "hung up");
        assert_eq!(sim.take_unexpected(), ["unscripted line to qemu child \"vm1\": reboot"]);
        sim.signal(&record, 9).unwrap();
        assert_eq!(sim.liveness(&record), Liveness::Signalled(9));
        let third = sim.spawn("kvm", "vm2", "qemu", &args).unwrap_err();
        assert!(matches!(third, BrokerError::Provider(m) if m.contains("no scripted child of qemu is left")));
    }

    /// A qemu child `vm1` serving `/data/q.sock`, spawned in a recorded run.
    fn spawned_on(tape: &ProcessTape) -> (ChildRecord, Vec<String>) {
        let args = strings(&["-qmp", "unix:/data/q.sock,server=on"]);
        let record = ChildRecord {
            provider: "kvm".into(),
            name: "vm1".into(),
            pid: 42,
            start_time: 1,
            program: "/usr/bin/qemu".into(),
            args: args.clone(),
            sandbox: None,
            log: String::new(),
        };
        tape.spawned(&record, "qemu", &args);
        (record, args)
    }

    #[test]
    fn a_recorded_conversation_replays_as_it_happened() {
        let tape = ProcessTape::default();
        let (record, args) = spawned_on(&tape);
        assert!(tape.connected("kvm", "/data/other.sock").is_none(), "no recorded child serves it");
        let first = tape.connected("kvm", "/data/q.sock").unwrap();
        tape.received(first, "hello");
        tape.sent(first, b"status\n");
        tape.received(first, "running");
        let second = tape.connected("kvm", "/data/q.sock").unwrap();
        tape.received(second, "hello");
        tape.sent(second, b"quit\n");
        tape.received(second, "bye");
        tape.observed(&record, Liveness::Running);
        tape.observed(&record, Liveness::Exited(0));

        let (runs, children) = tape.script();
        assert!(runs.is_empty());
        let sim = Arc::new(SimProcesses::new(runs, children));
        sim.spawn("kvm", "vm1", "qemu", &args).unwrap();
        let mut again = sim.connect_to("kvm", "/data/q.sock").unwrap();
        let mut heard = Vec::new();
        for line in ["status\n", "quit\n"] {
            heard.push(again.receive_line(5).unwrap().unwrap());
            again.send(line.as_bytes()).unwrap();
        }
        heard.push(again.receive_line(5).unwrap().unwrap());
        assert_eq!(heard, ["hello", "running", "bye"], "the greeting was recorded once");
        assert_eq!(again.receive_line(5).unwrap(), None, "quit ended it, as it did the real one");
        assert!(sim.take_unexpected().is_empty());
    }

    #[test]
    fn a_child_that_ended_before_a_word_replays_so() {
        let tape = ProcessTape::default();
        let (record, args) = spawned_on(&tape);
        tape.observed(&record, Liveness::Exited(1));
        let sim = Arc::new(SimProcesses::new(Vec::new(), tape.script().1));
        let replayed = sim.spawn("kvm", "vm1", "qemu", &args).unwrap();
        assert_eq!(sim.liveness(&replayed), Liveness::Exited(1));
        assert!(matches!(sim.connect_to("kvm", "/data/q.sock"), Err(SocketError::Missing(_))), "it serves nothing");
    }
}
