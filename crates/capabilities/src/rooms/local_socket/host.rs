//! `broker:provider/local-socket` for the guest: the WIT functions over a
//! [`LocalSocketView`].

use super::{HeldConnection, LocalSocketView};
use crate::bindings::BrokerError;
use crate::bindings::broker::provider::local_socket as wit;
use std::time::Duration;
use wasmtime::component::Resource;

impl wit::Host for LocalSocketView<'_> {
    async fn connect(&mut self, path: String) -> wasmtime::Result<Result<Resource<HeldConnection>, BrokerError>> {
        match self.ctx.connect(&path).await {
            Ok(connection) => Ok(Ok(self.table.push(connection)?)),
            Err(err) => {
                tracing::debug!(provider = %self.ctx.provider, path, error = %err, "local socket refused");
                Ok(Err(self.ctx.denials.refuse("local-socket", err.into())))
            }
        }
    }
}

impl wit::HostConnection for LocalSocketView<'_> {
    async fn send(
        &mut self,
        handle: Resource<HeldConnection>,
        data: Vec<u8>,
    ) -> wasmtime::Result<Result<(), BrokerError>> {
        Ok(self.table.get_mut(&handle)?.send(&data).await.map_err(BrokerError::from))
    }

    async fn receive_line(
        &mut self,
        handle: Resource<HeldConnection>,
        timeout_ms: u64,
    ) -> wasmtime::Result<Result<Option<String>, BrokerError>> {
        let connection = self.table.get_mut(&handle)?;
        Ok(connection.receive_line(Duration::from_millis(timeout_ms)).await.map_err(BrokerError::from))
    }

    async fn drop(&mut self, handle: Resource<HeldConnection>) -> wasmtime::Result<()> {
        self.table.delete(handle)?;
        self.ctx.closed_one();
        Ok(())
    }
}
