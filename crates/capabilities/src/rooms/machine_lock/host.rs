//! The WIT functions of `broker:provider/machine-lock`.

use super::{HeldLock, MachineLockView};
use crate::bindings::BrokerError;
use crate::bindings::broker::provider::machine_lock as wit;
use crate::machine_lock::{LockError, Spec};
use std::time::Duration;
use wasmtime::component::Resource;

fn to_broker_error(err: LockError) -> BrokerError {
    match err {
        LockError::Timeout => BrokerError::Timeout(err.to_string()),
        LockError::Cancelled => BrokerError::Aborted(err.to_string()),
        LockError::InvalidSpec(_) => BrokerError::InvalidParams(err.to_string()),
        LockError::Io { .. } => BrokerError::Provider(err.to_string()),
    }
}

impl wit::Host for MachineLockView<'_> {
    async fn acquire(
        &mut self,
        worker: String,
        comment: String,
        timeout_ms: u64,
    ) -> wasmtime::Result<Result<Resource<HeldLock>, BrokerError>> {
        let Some(lock) = self.ctx.lock.clone() else {
            let refusal = BrokerError::AccessDenied(
                "machine-lock is not granted: add `machine-lock = true` under [grants]".into(),
            );
            return Ok(Err(self.ctx.denials.refuse("machine-lock", refusal)));
        };
        let spec = Spec {
            worker,
            comment,
            timeout: (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)),
            abort: Some(self.ctx.abort.clone()),
        };
        match lock.acquire(spec).await {
            Ok(guard) => {
                let handle = self.table.push(HeldLock(guard))?;
                self.ctx.handed_out.push(handle.rep());
                Ok(Ok(handle))
            }
            Err(e) => Ok(Err(to_broker_error(e))),
        }
    }
}

impl wit::HostLockGuard for MachineLockView<'_> {
    async fn release(&mut self, handle: Resource<HeldLock>) -> wasmtime::Result<()> {
        self.table.get_mut(&handle)?.0.release();
        Ok(())
    }

    async fn drop(&mut self, handle: Resource<HeldLock>) -> wasmtime::Result<()> {
        let rep = handle.rep();
        self.ctx.handed_out.retain(|r| *r != rep);
        // Dropping the guard releases the lock.
        self.table.delete(handle)?;
        Ok(())
    }
}
