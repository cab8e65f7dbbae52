//! Where the server is in its life. At the bottom of the house: the request pipeline, the
//! gRPC adapter, the controller's task and admin HTTP all watch it, and it imports nothing.

use tokio::sync::watch;

/// Where the server is in its life; tasks watch it to end deliberately at shutdown.
/// Ordered: each state follows the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lifecycle {
    Serving,
    /// SIGTERM received: health says NOT_SERVING; queued requests get 503; streams already
    /// admitted carry on.
    Draining,
    /// The drain deadline passed: every stream still open ends now.
    Closing,
}

/// Resolves once the server's lifecycle is at `state` or past it (or its sender is gone).
pub async fn reached(lifecycle: &mut watch::Receiver<Lifecycle>, state: Lifecycle) {
    // The borrow guard wait_for returns is not Send; drop it before anything else awaits.
    let _ = lifecycle.wait_for(|s| *s >= state).await.is_ok();
}
