//! The fake, with the conformance scenario its config's `breaks` names broken.

mod broken;
#[path = "../../fake/src/provider.rs"]
mod fake;

/// `describe` takes no config: breaking it is a build of its own (test-broken-describe).
const BREAKS_DESCRIBE: bool = false;

broker_guest::export_provider!(Broken);

use broken::Broken;
