//! The fair queue as Envoy sees it, with paused time: tollgate runs in-process over an in-memory
//! transport, so the clock only moves when every task waits, and deadlines are exact.

use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingResponse, processing_response::Response,
};
use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tollgate::config::Config;

use crate::support::server::*;

/// tollgate served over in-memory pipes.
struct InMemory {
    client: ExternalProcessorClient<tonic::transport::Channel>,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tollgate::Error>>,
}

impl InMemory {
    async fn start(config: Config) -> InMemory {
        let (connections, incoming) =
            mpsc::unbounded_channel::<std::io::Result<tokio::io::DuplexStream>>();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(tollgate::serve(
            config,
            UnboundedReceiverStream::new(incoming),
            admin,
            async move {
                let _ = stop.await;
            },
            None,
        ));
        let channel = tonic::transport::Endpoint::from_static("http://in-memory")
            .connect_with_connector(tower::service_fn(move |_| {
                let (client, server) = tokio::io::duplex(1 << 20);
                let sent = connections.send(Ok(server));
                async move {
                    sent.map_err(|_| std::io::Error::other("server gone"))?;
                    Ok::<_, std::io::Error>(TokioIo::new(client))
                }
            }))
            .await
            .expect("in-memory channel");
        InMemory {
            client: ExternalProcessorClient::new(channel),
            shutdown: Some(shutdown),
            task,
        }
    }

    async fn stream(&self) -> ExtProcStream {
        ExtProcStream::open(&mut self.client.clone()).await
    }

    /// A chat request from `user` whose body got its first answer.
    async fn submit(&self, user: &str) -> (ExtProcStream, ProcessingResponse) {
        let mut stream = self.stream().await;
        stream.exchange(chat_headers(user)).await;
        let answer = stream
            .exchange(request_body(&chat_body(serde_json::json!({}))))
            .await;
        (stream, answer)
    }

    /// A chat request from `user` with this body, whose body got its first answer.
    async fn submit_body(&self, user: &str, body: &[u8]) -> (ExtProcStream, ProcessingResponse) {
        let mut stream = self.stream().await;
        stream.exchange(chat_headers(user)).await;
        let answer = stream.exchange(request_body(body)).await;
        (stream, answer)
    }

    async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        (&mut self.task).await.unwrap().unwrap();
    }
}

/// One slot, no controller, no per-user budgets (these tests are about the queue), free tier:
/// queue of `queue_max` with a 1 s deadline.
fn one_slot(queue_max: u32) -> Config {
    let mut config = Config::default();
    config.scheduler.initial_limit = 1;
    config.control.enabled = false;
    config.shutdown.drain_deadline_ms = 100;
    for tier in config.tiers.values_mut() {
        tier.max_concurrent = None;
        tier.tokens_per_hour = None;
    }
    let free = config.tiers.get_mut("free").unwrap();
    free.queue_max = queue_max;
    free.queue_deadline_ms = 1_000;
    config
}

/// `one_slot(8)`, with at most `cap` bytes of request bodies held by queued requests (and bodies
/// up to `cap` accepted, as the cap must allow).
fn one_slot_capped(cap: usize) -> Config {
    let mut config = one_slot(8);
    config.tokens.max_body_bytes = cap;
    config.scheduler.max_queued_body_bytes = cap;
    config
}

/// A chat body of exactly `bytes`. With `max_tokens` named and no streaming, tollgate sends it on
/// unchanged, so a queued request holds exactly `bytes`; without, tollgate writes the tier's
/// default `max_tokens` into a rewritten copy, which the request holds too.
fn body_of(bytes: usize, names_max_tokens: bool) -> Vec<u8> {
    let with = |content: &str| {
        let mut extra = serde_json::json!({"messages": [{"role": "user", "content": content}]});
        if names_max_tokens {
            extra["max_tokens"] = 16.into();
        }
        chat_body(extra)
    };
    let body = with(&"a ".repeat(bytes)[..bytes - with("").len()]);
    assert_eq!(body.len(), bytes);
    body
}

fn is_admitted(answer: &ProcessingResponse) -> bool {
    matches!(answer.response, Some(Response::RequestBody(_)))
}

/// The status and x-tollgate-reason of an immediate response.
fn refusal(answer: &ProcessingResponse) -> (i32, String, Option<String>) {
    let Some(Response::ImmediateResponse(reply)) = &answer.response else {
        panic!("expected an immediate response, got {answer:?}");
    };
    let header = |name: &str| {
        reply
            .headers
            .as_ref()
            .unwrap()
            .set_headers
            .iter()
            .find_map(|h| {
                let h = h.header.as_ref().unwrap();
                (h.key == name).then(|| String::from_utf8(h.raw_value.clone()).unwrap())
            })
    };
    (
        reply.status.as_ref().unwrap().code,
        header("x-tollgate-reason").unwrap(),
        header("retry-after"),
    )
}

/// The message timeout Envoy is asked to apply, if this answer is such a request.
fn envoy_timeout(answer: &ProcessingResponse) -> Option<Duration> {
    let timeout = answer.override_message_timeout.as_ref()?;
    assert!(
        answer.response.is_none(),
        "an override carries nothing else"
    );
    Some(Duration::new(timeout.seconds as u64, timeout.nanos as u32))
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_extends_envoys_timeout_and_gets_503_at_its_deadline() {
    let server = InMemory::start(one_slot(1)).await;
    let (_holder, answer) = server.submit("alice").await;
    assert!(is_admitted(&answer));

    let started = Instant::now();
    let (mut waiting, answer) = server.submit("bob").await;
    assert_eq!(
        envoy_timeout(&answer),
        Some(Duration::from_millis(1_500)),
        "deadline + margin, so tollgate's 503 beats Envoy's 504"
    );
    let answer = waiting.recv().await.unwrap().unwrap();
    assert_eq!(
        refusal(&answer),
        (503, "queue_timeout".to_owned(), Some("1".to_owned()))
    );
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(1),
        "exactly at the deadline"
    );
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_answers_503_at_once() {
    let server = InMemory::start(one_slot(1)).await;
    let (_holder, _) = server.submit("alice").await;
    let (_waiting, _) = server.submit("bob").await;
    let started = Instant::now();
    let (_, answer) = server.submit("bob").await;
    assert_eq!(
        refusal(&answer),
        (503, "queue_full".to_owned(), Some("1".to_owned()))
    );
    assert_eq!(started.elapsed(), Duration::ZERO);
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_the_queue_frees_its_place_and_takes_no_slot() {
    let server = InMemory::start(one_slot(1)).await;
    let (mut holder, _) = server.submit("alice").await;
    let (waiting, answer) = server.submit("bob").await;
    assert!(envoy_timeout(&answer).is_some());
    // Envoy resets the side stream when the client goes away.
    drop(waiting);
    tokio::time::sleep(Duration::from_millis(1)).await;

    // bob's place is free again: another request queues instead of being refused.
    let (mut next, answer) = server.submit("bob").await;
    assert!(
        envoy_timeout(&answer).is_some(),
        "queued, not refused: {answer:?}"
    );
    // And the slot went to nobody while it was held: alice finishes, the new request runs.
    holder
        .exchange(response_headers(200, "application/json"))
        .await;
    holder.exchange(response_body(b"{}", true)).await;
    let answer = next.recv().await.unwrap().unwrap();
    assert!(is_admitted(&answer), "{answer:?}");
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_answers_every_queued_stream_with_503() {
    let server = InMemory::start(one_slot(4)).await;
    let (mut holder, _) = server.submit("alice").await;
    let mut queued = Vec::new();
    for user in ["bob", "carol", "dave"] {
        let (stream, answer) = server.submit(user).await;
        assert!(envoy_timeout(&answer).is_some());
        queued.push(stream);
    }
    let started = Instant::now();
    let InMemory { shutdown, task, .. } = server;
    let _ = shutdown.unwrap().send(());
    for stream in &mut queued {
        let answer = stream.recv().await.unwrap().unwrap();
        assert_eq!(refusal(&answer).0, 503);
        assert_eq!(refusal(&answer).1, "shutting_down");
    }
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "at once, not at the queue deadline"
    );
    // The admitted stream is let go with OK at the drain deadline: Envoy finishes without us.
    assert!(holder.recv().await.unwrap().is_none());
    task.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn slots_are_shared_by_tier_weight_under_contention() {
    // One slot; a premium (weight 4) and a free (weight 1) tenant both keep a queue. Of the
    // slots that free up, premium gets four for every one free gets.
    let mut config = one_slot(8);
    config.tiers.get_mut("premium").unwrap().queue_max = 8;
    config.tiers.get_mut("free").unwrap().queue_deadline_ms = 10_000;
    config.tiers.get_mut("premium").unwrap().queue_deadline_ms = 10_000;
    let server = InMemory::start(config).await;
    let (mut holder, _) = server.submit("warmup").await;

    let mut waiting = Vec::new();
    for i in 0..5 {
        for (user, tier) in [("paying", "premium"), ("cheap", "free")] {
            let mut stream = server.stream().await;
            stream
                .exchange(request_headers(
                    &[
                        (":method", "POST"),
                        (":path", "/v1/chat/completions"),
                        ("x-user-id", user),
                        ("x-user-tier", tier),
                    ],
                    false,
                ))
                .await;
            let answer = stream
                .exchange(request_body(&chat_body(serde_json::json!({}))))
                .await;
            assert!(envoy_timeout(&answer).is_some(), "{user} #{i} queued");
            waiting.push((user, stream));
        }
    }
    // Release the slot and let each admitted request finish at once, recording the order.
    let mut order = Vec::new();
    holder.exchange(response_body(b"{}", true)).await;
    drop(holder);
    for _ in 0..5 {
        let mut admitted = None;
        for (i, (user, stream)) in waiting.iter_mut().enumerate() {
            if let Ok(Ok(Some(answer))) =
                tokio::time::timeout(Duration::from_millis(1), stream.recv_raw()).await
            {
                assert!(is_admitted(&answer));
                order.push(*user);
                admitted = Some(i);
                break;
            }
        }
        let (_, mut stream) = waiting.remove(admitted.expect("someone got the slot"));
        stream.exchange(response_body(b"{}", true)).await;
    }
    let paying = order.iter().filter(|user| **user == "paying").count();
    assert_eq!(
        (paying, order.len() - paying),
        (4, 1),
        "4:1 by weight: {order:?}"
    );
    let InMemory { shutdown, task, .. } = server;
    let _ = shutdown.unwrap().send(());
    task.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_take_queued_bodies_over_the_cap_gets_503_at_once() {
    let server = InMemory::start(one_slot_capped(10_000)).await;
    let body = body_of(4_000, true);
    let (_holder, answer) = server.submit_body("alice", &body).await;
    assert!(
        is_admitted(&answer),
        "a request that runs at once is not counted"
    );

    // Two 4,000-byte bodies wait within 10,000 bytes; a third would take them to 12,000.
    let (leaving, answer) = server.submit_body("bob", &body).await;
    assert!(envoy_timeout(&answer).is_some());
    let (_carol, answer) = server.submit_body("carol", &body).await;
    assert!(envoy_timeout(&answer).is_some());
    let started = Instant::now();
    let (_, answer) = server.submit_body("dave", &body).await;
    assert_eq!(
        refusal(&answer),
        (503, "queue_bytes_full".to_owned(), Some("1".to_owned()))
    );
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "at once, not at a deadline"
    );
    // What is left still takes a smaller body.
    let (_erin, answer) = server.submit_body("erin", &body_of(2_000, true)).await;
    assert!(envoy_timeout(&answer).is_some());

    // A client that leaves gives its bytes back: 4,000 + 2,000 held, room for 4,000 again.
    drop(leaving);
    tokio::time::sleep(Duration::from_millis(1)).await;
    let (_dave, answer) = server.submit_body("dave", &body).await;
    assert!(envoy_timeout(&answer).is_some(), "{answer:?}");
    let (_, answer) = server.submit_body("frank", &body_of(100, true)).await;
    assert_eq!(refusal(&answer).1, "queue_bytes_full");

    // At the deadline every waiting request is answered and gives its bytes back: the whole
    // cap is free for one body that fills it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_grace, answer) = server.submit_body("grace", &body_of(10_000, true)).await;
    assert!(envoy_timeout(&answer).is_some(), "{answer:?}");
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_rewritten_body_counts_with_the_body_envoy_sent() {
    // Room for 4,000 bytes twice: enough for one body kept as sent, not for one whose rewritten
    // copy (the tier's max_tokens written in) waits with it.
    let server = InMemory::start(one_slot_capped(8_000)).await;
    let (_holder, answer) = server.submit_body("alice", &body_of(4_000, true)).await;
    assert!(is_admitted(&answer));
    let (_, answer) = server.submit_body("bob", &body_of(4_000, false)).await;
    assert_eq!(refusal(&answer).1, "queue_bytes_full");
    let (_carol, answer) = server.submit_body("carol", &body_of(4_000, true)).await;
    assert!(envoy_timeout(&answer).is_some(), "{answer:?}");
    server.stop().await;
}

/// A configuration read by the real loader from YAML, so the keys are the ones operators write:
/// `control.enabled: false` and a short drain, then `yaml` (which names its own tiers and
/// scheduler settings). Tiers named here have no per-user budgets unless `yaml` gives some.
fn from_yaml(yaml: &str) -> Config {
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    let text = format!("control: {{enabled: false}}\nshutdown: {{drain_deadline_ms: 100}}\n{yaml}");
    std::fs::write(file.path(), text).unwrap();
    tollgate::config::load(Some(file.path()), Vec::<(String, String)>::new()).unwrap()
}

/// A chat request from `user` of `tier` asking for at most `max_tokens`, with its body's answer.
async fn submit_as(
    server: &InMemory,
    user: &str,
    tier: &str,
    max_tokens: u32,
) -> (ExtProcStream, ProcessingResponse) {
    let mut stream = server.stream().await;
    stream
        .exchange(request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("x-user-id", user),
                ("x-user-tier", tier),
            ],
            false,
        ))
        .await;
    let body = chat_body(serde_json::json!({"max_tokens": max_tokens}));
    let answer = stream.exchange(request_body(&body)).await;
    (stream, answer)
}

/// `submit_as`, for a request that must wait for a slot.
async fn queue_as(server: &InMemory, user: &str, tier: &str, max_tokens: u32) -> ExtProcStream {
    let (stream, answer) = submit_as(server, user, tier, max_tokens).await;
    assert!(
        envoy_timeout(&answer).is_some(),
        "{user} ({tier}) queued: {answer:?}"
    );
    stream
}

/// Ends `running`'s request (its slot is released) and returns the waiting request that got the
/// slot, taken out of `waiting`.
async fn hand_over(
    mut running: ExtProcStream,
    waiting: &mut Vec<(&'static str, ExtProcStream)>,
) -> (&'static str, ExtProcStream) {
    running.exchange(response_body(b"{}", true)).await;
    drop(running);
    // With paused time, a 1 ms wait only ends once every task is idle, so the slot has been
    // handed over by the time a stream is found without an answer.
    for (i, (_, stream)) in waiting.iter_mut().enumerate() {
        if let Ok(answer) = tokio::time::timeout(Duration::from_millis(1), stream.recv_raw()).await
        {
            let answer = answer.unwrap().unwrap();
            assert!(is_admitted(&answer), "{answer:?}");
            return waiting.remove(i);
        }
    }
    panic!("nobody got the freed slot");
}

/// Ends `running`'s request and then each admitted one in turn, until `waiting` is empty; the
/// order in which the waiting requests got the slot.
async fn serve_in_turn(
    mut running: ExtProcStream,
    mut waiting: Vec<(&'static str, ExtProcStream)>,
) -> Vec<&'static str> {
    let mut order = Vec::new();
    while !waiting.is_empty() {
        let (who, next) = hand_over(running, &mut waiting).await;
        order.push(who);
        running = next;
    }
    order
}

#[tokio::test(start_paused = true)]
async fn a_higher_priority_band_is_served_before_a_backlogged_lower_one() {
    // One slot. `free` is band 1 with 8 times premium's weight and queues first, so neither
    // weight nor arrival order would put premium first: only its band 0 does.
    let server = InMemory::start(from_yaml(
        "scheduler: {initial_limit: 1}
default_tier: free
tiers:
  free: {weight: 8, priority_band: 1, queue_max: 4, queue_deadline_ms: 10000}
  premium: {weight: 1, priority_band: 0, queue_max: 4, queue_deadline_ms: 10000}
",
    ))
    .await;
    let (holder, answer) = submit_as(&server, "warmup", "free", 16).await;
    assert!(is_admitted(&answer));

    let mut waiting = Vec::new();
    for user in ["f1", "f2", "f3"] {
        waiting.push(("free", queue_as(&server, user, "free", 16).await));
    }
    for user in ["p1", "p2"] {
        waiting.push(("premium", queue_as(&server, user, "premium", 16).await));
    }
    let mut order = Vec::new();
    let mut running = holder;
    for _ in 0..3 {
        let (who, next) = hand_over(running, &mut waiting).await;
        order.push(who);
        running = next;
    }
    // Premium arrives again while free runs, behind two waiting free requests: it goes first.
    waiting.push(("premium", queue_as(&server, "p3", "premium", 16).await));
    order.extend(serve_in_turn(running, waiting).await);
    assert_eq!(
        order,
        ["premium", "premium", "free", "premium", "free", "free"],
        "band 0 whenever it waits"
    );
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_reserved_tenant_holds_its_share_while_another_floods_the_queue() {
    // Four slots; `steady` (weight 1) has 50% reserved, i.e. 2 slots. `flood` (weight 4) holds
    // all four slots and has eight more requests waiting before steady's first one arrives.
    let server = InMemory::start(from_yaml(
        "scheduler:
  initial_limit: 4
  reservations: {steady: 50}
default_tier: free
tiers:
  free: {weight: 1, queue_max: 8, queue_deadline_ms: 10000}
  premium: {weight: 4, queue_max: 8, queue_deadline_ms: 10000}
",
    ))
    .await;
    let mut running = std::collections::VecDeque::new();
    for _ in 0..4 {
        let (stream, answer) = submit_as(&server, "flood", "premium", 16).await;
        assert!(is_admitted(&answer));
        running.push_back(("flood", stream));
    }
    let mut waiting = Vec::new();
    for _ in 0..8 {
        waiting.push(("flood", queue_as(&server, "flood", "premium", 16).await));
    }
    for _ in 0..6 {
        waiting.push(("steady", queue_as(&server, "steady", "free", 16).await));
    }

    // Free slots one at a time, oldest request first, until steady has nothing left waiting;
    // after each hand-over, note who got the slot and how many slots steady holds.
    let mut steps = Vec::new();
    while waiting.iter().any(|(who, _)| *who == "steady") {
        let (_, oldest) = running.pop_front().unwrap();
        let (who, stream) = hand_over(oldest, &mut waiting).await;
        running.push_back((who, stream));
        let held = running.iter().filter(|(who, _)| *who == "steady").count();
        steps.push((who, held));
    }
    assert_eq!(
        steps[..2],
        [("steady", 1), ("steady", 2)],
        "the first two free slots fill steady's reservation, despite flood's weight and its \
         earlier place in line: {steps:?}"
    );
    assert!(
        steps[2..].iter().all(|&(_, held)| held >= 2),
        "then steady holds at least half the slots while it has demand: {steps:?}"
    );
    server.stop().await;
}

/// The order in which a tenant asking for 1,000 output tokens per request (`big`, queued first)
/// and one asking for 10 (`small`), both weight 1, get one slot, with `scheduler.cost: {cost}`.
async fn dispatch_order_with_cost(cost: &str) -> Vec<&'static str> {
    let server = InMemory::start(from_yaml(&format!(
        "scheduler: {{initial_limit: 1, cost: {cost}}}
default_tier: free
tiers:
  free: {{weight: 1, queue_max: 4, queue_deadline_ms: 10000}}
"
    )))
    .await;
    let (holder, answer) = submit_as(&server, "warmup", "free", 16).await;
    assert!(is_admitted(&answer));
    let mut waiting = Vec::new();
    for _ in 0..3 {
        waiting.push(("big", queue_as(&server, "big", "free", 1_000).await));
    }
    for _ in 0..3 {
        waiting.push(("small", queue_as(&server, "small", "free", 10).await));
    }
    let order = serve_in_turn(holder, waiting).await;
    server.stop().await;
    order
}

#[tokio::test(start_paused = true)]
async fn the_fairness_cost_unit_decides_between_large_and_small_requests() {
    // Counted in requests, equal weights alternate, the earlier arrival first.
    assert_eq!(
        dispatch_order_with_cost("requests").await,
        ["big", "small", "big", "small", "big", "small"]
    );
    // Counted in tokens, one big request (about 1,000) costs as much as all three small ones
    // (about 20 each): they overtake big's second and third, which arrived before them.
    assert_eq!(
        dispatch_order_with_cost("tokens").await,
        ["big", "small", "small", "small", "big", "big"]
    );
}
