//! Why a group call failed.

use super::spec::SpecError;
use crate::broker::BrokerServiceError;
use crate::store::StoreError;

/// Why a group call failed.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// The spec was refused.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// No group of this id is committed.
    #[error("no group {0:?} is committed (`broker group ls` lists them)")]
    UnknownGroup(String),
    /// The spec names a provider that is not registered.
    #[error("group spec field Properties.Instance.Plugin: no provider {0:?} is registered")]
    UnknownProvider(String),
    /// A committed group's provider cannot change under its instances.
    #[error(
        "group spec field Properties.Instance.Plugin: group {group:?}'s instances are provider {was:?}'s; free or destroy the group to move it to {now:?}"
    )]
    ProviderChanged {
        /// The group.
        group: String,
        /// Its provider.
        was: String,
        /// The one the new spec names.
        now: String,
    },
    /// `destroy-instances` named an instance that is not the group's.
    #[error("instance {id:?} is not a member of group {group:?}: nothing was destroyed")]
    NotAMember {
        /// The group.
        group: String,
        /// The first id that is not its member.
        id: String,
    },
    /// A group cannot switch between a size and logical ids.
    #[error(
        "group spec field Properties.Allocation: group {group:?} is committed with {was}; a spec with {now} cannot replace it (free or destroy the group first)"
    )]
    AllocationChanged {
        /// The group.
        group: String,
        /// What it is committed with.
        was: &'static str,
        /// What the new spec gives.
        now: &'static str,
    },
    /// The host keeps at most [`MAX_GROUPS`] groups.
    #[error("{0} groups are committed, the most one host keeps: destroy or free one first")]
    TooManyGroups(usize),
    /// A committed spec does not read back (a damaged store, or an older host's spec).
    #[error("group {group:?}: its stored spec does not read ({why}); commit a new spec for it, or free it")]
    StoredSpec {
        /// The group.
        group: String,
        /// What is wrong with it.
        why: String,
    },
    /// The group's provider is gone, so its instances cannot be stopped.
    #[error(
        "group {group:?}: its provider {provider:?} is not registered, so its instances cannot be stopped; `broker group free {group}` forgets the group and leaves them"
    )]
    ProviderGone {
        /// The group.
        group: String,
        /// Its provider.
        provider: String,
    },
    /// The group is forgotten but stopping its members failed.
    #[error(
        "group {group:?} is destroyed, but stopping its {count} instances failed (they stay marked for stopping: `broker stop` or the next restart's reconcile finishes them)"
    )]
    StopsUnfinished {
        /// The group.
        group: String,
        /// How many members it had.
        count: usize,
        /// Why the stop failed.
        #[source]
        source: Box<BrokerServiceError>,
    },
    /// A quorum group's size is its logical ids.
    #[error(
        "group {0:?} is a quorum group (LogicalIDs): its size is its logical ids; commit a new spec to change them"
    )]
    QuorumSize(String),
    /// A convergence pass panicked (a host bug): the loop goes on after its backoff.
    #[error("group {0:?}: a convergence pass panicked (a bug in the host); the next pass tries again")]
    PassPanicked(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A broker call failed.
    #[error(transparent)]
    Broker(#[from] BrokerServiceError),
}
