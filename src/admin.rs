//! Admin HTTP: `/metrics` (Prometheus text), `/healthz` (the process is alive) and `/readyz`
//! (send it traffic: false while draining, so Kubernetes and load balancers stop routing here
//! before the gRPC listener goes away; and false until the budget is settled: a fleet member
//! is not ready before its first sync has given it a share or sent it to a local budget, so it
//! does not take traffic it would only queue).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::sync::watch;

use std::sync::Arc;

use crate::lifecycle::Lifecycle;
use crate::observe::Metrics;
use crate::scheduler::Scheduler;

#[derive(Clone)]
struct AdminState {
    metrics: Metrics,
    scheduler: Arc<Scheduler>,
    lifecycle: watch::Receiver<Lifecycle>,
    budget_ready: watch::Receiver<bool>,
}

pub fn router(
    metrics: Metrics,
    scheduler: Arc<Scheduler>,
    lifecycle: watch::Receiver<Lifecycle>,
    budget_ready: watch::Receiver<bool>,
) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AdminState {
            metrics,
            scheduler,
            lifecycle,
            budget_ready,
        })
}

async fn metrics_text(State(state): State<AdminState>) -> impl IntoResponse {
    // The budget's gauges are read at scrape time: exact, and nothing on the request path
    // has to keep them current.
    state.metrics.scheduler_load(state.scheduler.load());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    match *state.lifecycle.borrow() {
        Lifecycle::Serving if !*state.budget_ready.borrow() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for a share of the fleet's budget\n",
        ),
        Lifecycle::Serving => (StatusCode::OK, "ready\n"),
        Lifecycle::Draining | Lifecycle::Closing => (StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
    }
}
