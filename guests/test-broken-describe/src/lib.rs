//! The fake with a `describe` that leaves its version empty.

#[path = "../../test-broken/src/broken.rs"]
mod broken;
#[path = "../../fake/src/provider.rs"]
mod fake;

const BREAKS_DESCRIBE: bool = true;

broker_guest::export_provider!(Broken);

use broken::Broken;
