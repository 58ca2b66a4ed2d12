//! Every benchmark, in one binary (one link of the host, not thirteen):
//! `cargo bench -p broker-tests --bench all -- NAME` runs those whose id
//! matches NAME (`all_instances`, `vm_start`, `durable_start/16$`, …); CI runs
//! each once in criterion's test mode (`cargo test --benches`).

mod all_instances;
mod bystander;
mod confinement;
mod conformance;
mod durable_start;
mod ec2_calls;
mod egress_signing;
mod groups;
mod hot_swap;
mod kv_mirror;
mod list_scale;
mod lxd_start;
mod vm_start;

criterion::criterion_main!(
    all_instances::benches,
    bystander::benches,
    confinement::benches,
    conformance::benches,
    durable_start::benches,
    ec2_calls::benches,
    egress_signing::benches,
    groups::benches,
    hot_swap::benches,
    kv_mirror::benches,
    list_scale::benches,
    lxd_start::benches,
    vm_start::benches,
);
