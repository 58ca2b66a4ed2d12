//! A real EC2-compatible server for the cloud tests: moto (installed by
//! scripts/install-test-deps.sh into `target/moto-venv`) on 127.0.0.1 with
//! signature checking on, behind a TLS front the test starts with a CA of
//! its own, so the host's real path is https. Both stop when dropped.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The credential moto's IAM made for the tests (every action allowed).
pub struct Key {
    pub access_key_id: String,
    pub secret_access_key: String,
}

/// moto_server, stopped by its pid when dropped.
pub struct Moto {
    child: Child,
    pub port: u16,
    pub key: Key,
}

fn venv() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/moto-venv/bin")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// The requests moto answers before it checks signatures: the three that make the tests' IAM user.
const SETUP_REQUESTS: &str = "3";

/// Makes the tests' IAM user (shared with scripts/record-ec2-script.sh).
const SETUP: &str = include_str!("../../scripts/moto-iam-setup.py");

impl Moto {
    /// Start moto with signature checking on (after the setup's requests) and make the tests' key.
    pub fn start() -> Moto {
        let server = venv().join("moto_server");
        assert!(server.exists(), "no {}: run scripts/install-test-deps.sh (scripts/test.sh does)", server.display());
        let port = free_port();
        let child = Command::new(&server)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .env("INITIAL_NO_AUTH_ACTION_COUNT", SETUP_REQUESTS)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server");
        let mut moto =
            Moto { child, port, key: Key { access_key_id: String::new(), secret_access_key: String::new() } };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not listen on {port} within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        let out = Command::new(venv().join("python"))
            .args(["-c", SETUP, &format!("http://127.0.0.1:{port}"), "broker"])
            .output()
            .expect("run the IAM setup");
        assert!(out.status.success(), "IAM setup: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (id, secret) = text.trim().split_once(' ').expect("a key id and a secret");
        moto.key = Key { access_key_id: id.to_owned(), secret_access_key: secret.to_owned() };
        moto
    }
}

impl Moto {
    /// Run `script` with boto3 against moto directly (no host, no front), as
    /// the tests' IAM user: `ec2` is a client for us-east-1. Its stdout.
    pub fn boto3(&self, script: &str) -> String {
        let prelude = "import boto3, json, sys\nec2 = boto3.client('ec2', endpoint_url=sys.argv[1], \
                       region_name='us-east-1', aws_access_key_id=sys.argv[2], aws_secret_access_key=sys.argv[3])\n";
        let out = Command::new(venv().join("python"))
            .args(["-c", &format!("{prelude}{script}")])
            .args([&format!("http://127.0.0.1:{}", self.port), &self.key.access_key_id, &self.key.secret_access_key])
            .output()
            .expect("run python");
        assert!(out.status.success(), "boto3: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// A TLS terminator in front of a TCP server: a certificate for `localhost`
/// from a CA made here (its PEM for the grant's `ca-file`); each connection
/// counted, then copied both ways. The host sends one request per connection.
pub struct TlsFront {
    pub port: u16,
    pub ca_pem: String,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// In front of `127.0.0.1:upstream`; call inside a tokio runtime.
    pub async fn start(upstream: u16) -> TlsFront {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().expect("key");
        let leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("certificate");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key der"),
            )
            .expect("server config");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, counted) = (acceptor.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    counted.fetch_add(1, Ordering::SeqCst);
                    if let Ok(mut plain) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    }
                });
            }
        });
        TlsFront { port, ca_pem: ca_cert.pem(), connections, task }
    }

    /// The requests that reached the front so far.
    pub fn requests(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
