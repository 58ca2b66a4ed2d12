//! The fake provider component (Juju's "dummy" broker): instances live in kv.

mod provider;

use provider::Fake;

broker_guest::export_provider!(Fake);
