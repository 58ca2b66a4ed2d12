//! Network namespaces for tests that touch real links: each test makes its own.

#![allow(clippy::unwrap_used)] // test support: a panic is the failure report

use broker_capabilities::network::netlink::Netlink;
use nix::sched::{CloneFlags, unshare};
use rtnetlink::LinkVeth;
use std::future::Future;

/// Run `test` on a thread inside a fresh network namespace, with its own runtime.
pub fn in_netns<F, Fut>(test: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    std::thread::spawn(move || {
        unshare(CloneFlags::CLONE_NEWNET).expect(
            "unshare(CLONE_NEWNET) was refused: these tests need root (or CAP_SYS_ADMIN) and network namespaces",
        );
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(test());
    })
    .join()
    .expect("the namespaced test panicked");
}

/// A "NIC" (one end of a veth pair, the other end `<name>p`) with a MAC and an address, up.
pub async fn make_nic(name: &str, mac: [u8; 6], address: &str) {
    let (connection, handle, _) = rtnetlink::new_connection().unwrap();
    tokio::spawn(connection);
    let peer = format!("{name}p");
    handle.link().add(LinkVeth::new(name, &peer).address(mac.to_vec()).up().build()).execute().await.unwrap();
    let nl = Netlink::connect().unwrap();
    let index = nl.device(name).await.unwrap().unwrap().index;
    let (ip, prefix) = address.split_once('/').unwrap();
    handle.address().add(index, ip.parse().unwrap(), prefix.parse().unwrap()).execute().await.unwrap();
}

/// Run `test` on a thread inside an existing network namespace (`/proc/<pid>/ns/net`), with its own runtime.
pub fn in_netns_of<F, Fut>(namespace: std::path::PathBuf, test: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    std::thread::spawn(move || {
        let file = std::fs::File::open(&namespace).unwrap();
        nix::sched::setns(&file, CloneFlags::CLONE_NEWNET).expect("setns(CLONE_NEWNET) into the daemon's namespace");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(test());
    })
    .join()
    .expect("the namespaced test panicked");
}
