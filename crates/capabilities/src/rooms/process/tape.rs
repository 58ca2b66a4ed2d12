//! Recording a real run's programs, children and socket conversations, so it
//! can be replayed by [`super::simulated::SimProcesses`]: every run with its
//! output; every spawn as a scripted child; what each child greeted with and
//! answered to each line; and, when the provider sees a child end, that the
//! last line it was sent ended it (a QMP `quit`) unless the provider killed it,
//! or, if it was sent none, that it ended by itself.

use super::children::{ChildRecord, Liveness};
use super::simulated::{Answer, ScriptedChild, ScriptedRun};
use crate::bindings::broker::provider::process::Output;
use crate::rooms::local_socket::{Connection, SocketAt, SocketBackend, SocketError};
use futures_util::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
struct Recorded {
    runs: Vec<ScriptedRun>,
    children: Vec<ScriptedChild>,
    /// (provider, child name) → its entry in `children` and its arguments as the provider wrote them.
    live: BTreeMap<(String, String), (usize, Vec<String>)>,
    connections: Vec<Conversation>,
    /// Children whose end is accounted for (signalled, or already seen ended).
    settled: Vec<(String, String)>,
}

#[derive(Clone, Copy)]
struct Conversation {
    /// The child entry it talks to.
    entry: usize,
    /// The answer being filled: to the last line sent.
    answering: Option<usize>,
    /// The first connection to its child: what it reads before sending is the greeting.
    first: bool,
}

/// What a recorded run's programs, children and connections did; [`ProcessTape::script`] replays it.
#[derive(Default)]
pub struct ProcessTape {
    recorded: Mutex<Recorded>,
}

/// A recorded connection, as [`ProcessTape::connected`] numbered it.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionId(usize);

impl ProcessTape {
    fn lock(&self) -> MutexGuard<'_, Recorded> {
        self.recorded.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn ran(&self, program: &str, args: &[String], output: &Output) {
        self.lock().runs.push(ScriptedRun {
            program: program.to_owned(),
            args: args.to_vec(),
            exit_code: output.exit_code,
            signal: output.signal,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            timed_out: output.timed_out,
        });
    }

    pub(crate) fn spawned(&self, record: &ChildRecord, program: &str, guest_args: &[String]) {
        let mut recorded = self.lock();
        recorded.children.push(ScriptedChild { program: program.to_owned(), ..ScriptedChild::default() });
        let entry = recorded.children.len() - 1;
        let key = (record.provider.clone(), record.name.clone());
        recorded.settled.retain(|k| *k != key);
        recorded.live.insert(key, (entry, guest_args.to_vec()));
    }

    /// A connection to `guest_path`, if a recorded child serves it.
    pub fn connected(&self, provider: &str, guest_path: &str) -> Option<ConnectionId> {
        let mut recorded = self.lock();
        let entry = recorded
            .live
            .iter()
            .filter(|((p, _), _)| p == provider)
            .find(|(_, (_, args))| args.iter().any(|a| super::simulated::names_path(a, guest_path)))
            .map(|(_, (entry, _))| *entry)?;
        let first = !recorded.connections.iter().any(|c| c.entry == entry);
        recorded.connections.push(Conversation { entry, answering: None, first });
        Some(ConnectionId(recorded.connections.len() - 1))
    }

    pub(crate) fn sent(&self, connection: ConnectionId, data: &[u8]) {
        let mut recorded = self.lock();
        let entry = recorded.connections[connection.0].entry;
        for line in String::from_utf8_lossy(data).split_terminator('\n') {
            let answers = &mut recorded.children[entry].answers;
            answers.push(Answer { line: line.trim_end_matches('\r').to_owned(), reply: Vec::new(), exit: None });
            let at = answers.len() - 1;
            recorded.connections[connection.0].answering = Some(at);
        }
    }

    pub(crate) fn received(&self, connection: ConnectionId, line: &str) {
        let mut recorded = self.lock();
        let Conversation { entry, answering, first } = recorded.connections[connection.0];
        let child = &mut recorded.children[entry];
        match answering {
            Some(at) => child.answers[at].reply.push(line.to_owned()),
            // Read before anything was sent: the greeting, the same on every connection.
            None if first => child.greeting.push(line.to_owned()),
            None => {}
        }
    }

    /// The provider signalled the child: its end is the signal's doing.
    pub fn signalled(&self, record: &ChildRecord) {
        self.lock().settled.push((record.provider.clone(), record.name.clone()));
    }

    /// The provider saw the child's state; the first time it has ended on its
    /// own, the last line it was sent ended it.
    pub fn observed(&self, record: &ChildRecord, liveness: Liveness) {
        let code = match liveness {
            Liveness::Exited(code) => code,
            Liveness::Running | Liveness::Signalled(_) | Liveness::Gone => return,
        };
        let mut recorded = self.lock();
        let key = (record.provider.clone(), record.name.clone());
        if recorded.settled.contains(&key) {
            return;
        }
        recorded.settled.push(key.clone());
        if let Some(&(entry, _)) = recorded.live.get(&key) {
            let child = &mut recorded.children[entry];
            match child.answers.last_mut() {
                Some(last) => last.exit = Some(code),
                None => child.exit = Some(code),
            }
        }
    }

    /// What was recorded: the runs in order, the children in spawn order.
    pub fn script(&self) -> (Vec<ScriptedRun>, Vec<ScriptedChild>) {
        let recorded = self.lock();
        (recorded.runs.clone(), recorded.children.clone())
    }
}

/// Any socket backend, with what passes on each connection to a recorded
/// child written to the tape.
pub(crate) struct RecordedSockets<B> {
    inner: Arc<B>,
    tape: Arc<ProcessTape>,
}

impl<B: SocketBackend> RecordedSockets<B> {
    /// `inner`, each exchange written to `tape`.
    pub(crate) fn new(inner: B, tape: Arc<ProcessTape>) -> Self {
        RecordedSockets { inner: Arc::new(inner), tape }
    }
}

impl<B: SocketBackend> SocketBackend for RecordedSockets<B> {
    fn connect<'a>(self: Arc<Self>, at: SocketAt<'a>) -> BoxFuture<'a, Result<Box<dyn Connection>, SocketError>> {
        Box::pin(async move {
            let inner = self.inner.clone().connect(at).await?;
            Ok(match self.tape.connected(at.provider, at.guest_path) {
                Some(id) => Box::new(RecordedConnection { inner, tape: self.tape.clone(), id }) as Box<dyn Connection>,
                // No recorded child serves it: nothing to replay it against.
                None => inner,
            })
        })
    }
}

struct RecordedConnection {
    inner: Box<dyn Connection>,
    tape: Arc<ProcessTape>,
    id: ConnectionId,
}

impl Connection for RecordedConnection {
    fn send<'a>(&'a mut self, data: &'a [u8]) -> BoxFuture<'a, Result<(), SocketError>> {
        Box::pin(async move {
            self.inner.send(data).await?;
            self.tape.sent(self.id, data);
            Ok(())
        })
    }

    fn receive_line(&mut self, timeout: Duration) -> BoxFuture<'_, Result<Option<String>, SocketError>> {
        Box::pin(async move {
            let line = self.inner.receive_line(timeout).await?;
            if let Some(line) = &line {
                self.tape.received(self.id, line);
            }
            Ok(line)
        })
    }
}
