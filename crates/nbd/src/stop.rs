//! A one-way stop signal: set once, observed by any number of tasks.

use tokio::sync::watch;

/// The sending side. Dropping it without calling [`StopHandle::stop`] never fires the signal.
#[derive(Debug)]
pub struct StopHandle(watch::Sender<bool>);

/// The receiving side, cheap to clone.
#[derive(Debug, Clone)]
pub struct Stop(watch::Receiver<bool>);

impl StopHandle {
    pub fn new() -> StopHandle {
        StopHandle(watch::channel(false).0)
    }

    pub fn stop(&self) {
        self.0.send_replace(true);
    }

    pub fn subscribe(&self) -> Stop {
        Stop(self.0.subscribe())
    }

    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }
}

impl Default for StopHandle {
    fn default() -> Self {
        StopHandle::new()
    }
}

impl Stop {
    /// A signal that never fires.
    pub fn never() -> Stop {
        let (tx, rx) = watch::channel(false);
        // Keep the sender alive forever so `wait` pends instead of returning on a closed channel.
        std::mem::forget(tx);
        Stop(rx)
    }

    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the signal is set. If the handle was dropped without stopping, pends forever.
    pub async fn wait(&mut self) {
        if self.0.wait_for(|v| *v).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
