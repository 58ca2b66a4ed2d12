//! What a capability's host functions see of a store: its own context and
//! the resource table its handles live in (wasmtime's view pattern, once for all).

use std::marker::PhantomData;
use wasmtime::component::{HasData, ResourceTable};

/// A capability's per-store context and the store's resource table, borrowed together.
pub struct View<'a, C> {
    /// The capability's per-store context.
    pub ctx: &'a mut C,
    /// Where the capability's handles live.
    pub table: &'a mut ResourceTable,
}

/// [`View`] over `C`, as bindgen's `add_to_linker` names it.
pub(crate) struct ViewOf<C>(PhantomData<fn() -> C>);

impl<C: 'static> HasData for ViewOf<C> {
    type Data<'a> = View<'a, C>;
}
