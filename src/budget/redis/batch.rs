//! The decision path's calls (`reserve`, `settle`, `usage`) go to Redis in batches: a call that
//! comes while a batch is out waits for it, then goes with every other call that came meanwhile
//! as one pipeline (one write, one read of the replies). Each call is still its own `EVALSHA`,
//! atomic on its own and on its own tenant's hash slot, so a decision still makes one round trip
//! to reserve and one to settle, and Redis sees the same commands.
//!
//! Why: Redis's one thread is the ceiling every replica sharing it meets, and sent one by one
//! each call cost it a read, a reply's write and a turn of its event loop besides running the
//! script: about 10 µs of Redis's CPU per decision beyond its two scripts' 35 to 40, and 3 to 5
//! sent in batches (docs/benchmarks.md, "Calls that wait go together"). tollgate's own CPU per
//! decision stays where it was: fewer writes, one more hand-over between tasks.
//!
//! What it costs a call: a lone call goes after one yield to the runtime, which lets the tasks
//! ready on the sender's thread run first (under load, a whole run queue). A call then waits
//! for the batch ahead of it, which Redis, one thread, would have served first anyway, and for
//! the scripts' loading when Redis forgot them. Only one batch is out at a time, so one store
//! sends at most 64 calls per round trip to Redis (64,000 a second at 1 ms). The store's timeout
//! bounds a call from when it is made, the waiting included: in the benchmark's loaded runs the
//! reserve's mean went from 0.57-0.62 ms to 0.80-1.09 ms, its p99 staying about 2.5 ms
//! (docs/benchmarks.md, "Calls that wait go together"). Each batch's number of calls goes to
//! `tollgate_store_batch_calls`: batches mostly at the cap mean this one sender is the limit.
//!
//! A reserve or usage whose caller has gone (its own timeout ran out while it waited, or the
//! request ended) is not sent: unsent, it changes nothing, where sent late it would reserve for a
//! request that never learns it was granted. A settle goes whatever became of its caller, as it
//! did when each call was written at once: it ends a lease and gives back what was not used.

use std::panic::AssertUnwindSafe;
use std::sync::Weak;

use futures_util::FutureExt;
use redis::{Cmd, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

use super::{Inner, StoreError, is_noscript};

/// At most this many calls go in one pipeline; more wait for the next.
pub(super) const MAX_BATCH: usize = 64;

/// The script a call runs, for loading it again when Redis answers `NOSCRIPT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScriptName {
    Reserve,
    Settle,
    Usage,
}

/// One call waiting to go: its `EVALSHA` and where its answer goes.
pub(super) struct Call {
    pub(super) script: ScriptName,
    pub(super) command: Cmd,
    pub(super) reply: oneshot::Sender<Result<Value, StoreError>>,
}

/// Sends the calls in batches until the store is dropped (every sender with it).
pub(super) async fn run(mut calls: mpsc::UnboundedReceiver<Call>, store: Weak<Inner>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while calls.recv_many(&mut batch, MAX_BATCH).await > 0 {
        // The tasks that are ready now run first, and the calls they make join this batch:
        // without this the sender, woken by the first call, tended to run straight after its
        // caller, and batches stayed too small to spare Redis anything (docs/benchmarks.md,
        // "Calls that wait go together").
        tokio::task::yield_now().await;
        while batch.len() < MAX_BATCH
            && let Ok(call) = calls.try_recv()
        {
            batch.push(call);
        }
        batch.retain(|call: &Call| call.script == ScriptName::Settle || !call.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        // Gone only once the store is dropped (at shutdown): calls still queued then, a
        // settle whose caller left among them, are not sent, and their leases expire by TTL.
        let Some(store) = store.upgrade() else {
            return;
        };
        store.batch_calls.record(batch.len() as f64);
        // A panic in one batch (a bug here or in redis-rs) fails that batch's calls, not every
        // call after it: the sender is the only way the request path reaches Redis.
        let answers = match AssertUnwindSafe(store.send_batch(&mut batch))
            .catch_unwind()
            .await
        {
            Ok(answers) => answers,
            Err(_) => {
                tracing::error!("the Redis store's batch sender panicked: that batch's calls fail");
                let failed = StoreError::Unavailable("the Redis call's batch failed".into());
                vec![Err(failed); batch.len()]
            }
        };
        drop(store);
        for (call, answer) in batch.drain(..).zip(answers) {
            // The caller may have gone meanwhile; its answer then goes nowhere.
            let _ = call.reply.send(answer);
        }
    }
}

impl Inner {
    /// Sends `batch` as one pipeline and answers each call on its own: a call's error (a script
    /// error, `READONLY`) is its own, and a failure of the whole exchange (timeout, connection
    /// lost) is every call's. Calls answered `NOSCRIPT` go again once, after their scripts are
    /// loaded, within the same timeout. The commands are taken out of `batch`.
    async fn send_batch(&self, batch: &mut [Call]) -> Vec<Result<Value, StoreError>> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let (generation, mut connection) = self.connection();
        let mut pipe = redis::Pipeline::with_capacity(batch.len());
        pipe.ignore_errors();
        for call in batch.iter_mut() {
            pipe.add_command(std::mem::replace(&mut call.command, Cmd::new()));
        }
        let outcome =
            tokio::time::timeout_at(deadline, pipe.query_async::<Vec<Value>>(&mut connection))
                .await;
        let values = match self.replies(generation, outcome, batch.len()) {
            Ok(values) => values,
            Err(e) => return vec![Err(e); batch.len()],
        };
        let mut answers = Vec::with_capacity(batch.len());
        let mut again = Vec::new();
        for (index, value) in values.into_iter().enumerate() {
            let value = value.extract_error();
            if value.as_ref().is_err_and(is_noscript) {
                again.push(index);
            }
            answers.push(self.answer(generation, Ok(value)));
        }
        if again.is_empty() {
            return answers;
        }
        // Redis forgot the scripts (restart, failover, `SCRIPT FLUSH`): load each one needed
        // once, then send those calls again.
        let resend = tokio::time::timeout_at(deadline, async {
            let mut loaded: Vec<ScriptName> = Vec::new();
            let mut retry = redis::pipe();
            retry.ignore_errors();
            // The rare path: the commands are copied back out of the first pipeline.
            let sent: Vec<&Cmd> = pipe.cmd_iter().collect();
            for &index in &again {
                let script = batch[index].script;
                if !loaded.contains(&script) {
                    self.scripts
                        .named(script)
                        .load_async(&mut connection)
                        .await?;
                    loaded.push(script);
                }
                retry.add_command(sent[index].clone());
            }
            retry.query_async::<Vec<Value>>(&mut connection).await
        })
        .await;
        match self.replies(generation, resend, again.len()) {
            Ok(values) => {
                for (index, value) in again.into_iter().zip(values) {
                    answers[index] = self.answer(generation, Ok(value.extract_error()));
                }
            }
            Err(e) => {
                for index in again {
                    answers[index] = Err(e.clone());
                }
            }
        }
        answers
    }

    /// A pipeline's outcome as one reply per call, or the error every call gets.
    fn replies(
        &self,
        generation: u64,
        outcome: Result<RedisResult<Vec<Value>>, tokio::time::error::Elapsed>,
        calls: usize,
    ) -> Result<Vec<Value>, StoreError> {
        let values = self.answer(generation, outcome)?;
        if values.len() == calls {
            Ok(values)
        } else {
            Err(StoreError::Protocol(format!(
                "{} replies to a pipeline of {calls} calls",
                values.len()
            )))
        }
    }
}
