//! The end-to-end tests of the core with the built guests, one binary
//! (wasmtime and cranelift are linked once), but for the real-container
//! tests (`tests/lxd.rs`) and the real-VM ones (`broker-serve`'s
//! `tests/kvm.rs`), which run alone.
//! Each module is one subject;
//! `guest_tests` names a test of each guest the guest build makes, so a guest
//! added without a test does not compile.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod bridge;
mod cloud;
mod conformance;
mod contract;
mod fake_provider;
mod groups;
mod listing;
mod process;
mod quotas;
mod resume;
mod sandbox;
mod state;
mod swap;
mod versions;

/// One test for each guest component, by its crate name.
mod guest_tests {
    pub(crate) use crate::cloud::the_ec2_provider_runs_juju_s_broker_on_moto as ec2;
    pub(crate) use crate::conformance::each_broken_guest_fails_exactly_the_scenario_it_breaks_and_says_why as test_broken;
    pub(crate) use crate::conformance::each_broken_guest_fails_exactly_the_scenario_it_breaks_and_says_why as test_broken_describe;
    pub(crate) use crate::conformance::the_kvm_provider_passes_strictly_on_its_script_without_running_anything as kvm;
    pub(crate) use crate::conformance::the_lxd_provider_passes_strictly_on_the_script_it_ships_and_fails_without_one as lxd;
    pub(crate) use crate::fake_provider::lifecycle_pooled as fake;
    pub(crate) use crate::sandbox::trap_gives_typed_error_and_the_instance_is_never_reused as test_hostile;
    pub(crate) use crate::swap::swapping_under_load_loses_no_call_and_no_instance as fake_next;
    pub(crate) use crate::versions::components_built_against_0_1_0_and_0_2_0_run_beside_a_0_3_0_build as fake_v0_1;
    pub(crate) use crate::versions::components_built_against_0_1_0_and_0_2_0_run_beside_a_0_3_0_build as fake_v0_2;
}

guest_artifacts::every_guest_is_tested!(guest_tests);
