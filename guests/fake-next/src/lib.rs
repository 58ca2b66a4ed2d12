//! The fake provider's very source, built as another version (its
//! `describe` and start results say 0.2.0), so hot-swap tests can tell which
//! build answered a call.

#[path = "../../fake/src/provider.rs"]
mod provider;

use provider::Fake;

broker_guest::export_provider!(Fake);
