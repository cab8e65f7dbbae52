//! A request's life without gRPC: the in-memory store and paused time. Every ending settles the
//! budgets and frees the slot exactly once; every refusal answers from the one table.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::budget::Store;
use crate::budget::memory::MemoryStore;
use crate::config::{Config, TierConfig};
use crate::observe::ReportOutcome;

const TENANT: &str = "alice";
const QUEUE_DEADLINE: Duration = Duration::from_millis(1000);

/// One tier, `free`, with a token budget per minute, a concurrency limit and a short queue;
/// one global slot unless `edit` says otherwise.
fn pipeline_with(edit: impl FnOnce(&mut Config)) -> Pipeline {
    pipeline_and_rules(edit).0
}

/// As `pipeline_with`, and the sender that replaces its policy, as a reload does.
fn pipeline_and_rules(edit: impl FnOnce(&mut Config)) -> (Pipeline, watch::Sender<Arc<Rules>>) {
    let tier = TierConfig {
        max_input_tokens: 1000,
        max_output_tokens: 100,
        default_output_tokens: Some(50),
        tokens_per_minute: Some(10_000),
        max_concurrent: Some(4),
        queue_max: 2,
        queue_deadline_ms: QUEUE_DEADLINE.as_millis() as u64,
        ..TierConfig::default()
    };
    let mut config = Config {
        default_tier: "free".to_owned(),
        tiers: BTreeMap::from([("free".to_owned(), tier)]),
        ..Config::default()
    };
    config.scheduler.initial_limit = 1;
    edit(&mut config);
    let policy = Arc::new(test_policy(&config));
    let metrics = Metrics::new(&*policy);
    let scheduler = Scheduler::new(
        policy.scheduling.initial_limit,
        policy.scheduling.max_queued_body_bytes,
        policy.scheduling.headroom,
    );
    let ledger = Ledger::new(
        Store::Memory(MemoryStore::new()),
        policy.store.clone(),
        metrics.clone(),
    );
    let ttft_window = Arc::new(Mutex::new(LatencyWindow::new(Duration::from_secs(10), 10)));
    let (rules_tx, rules) = watch::channel(Rules::new(policy, &metrics));
    let pipeline = Pipeline {
        rules,
        metrics,
        scheduler,
        ledger,
        ttft_window,
        reports: Arc::new(Reports::new("test-replica".to_owned())),
        large_body_threads: Arc::new(Semaphore::new(large_body_permits(
            config.tokens.large_body_threads,
            1,
        ))),
    };
    (pipeline, rules_tx)
}

fn test_policy(config: &Config) -> crate::policy::Policy {
    crate::policy::Policy::from_config(config).expect("a valid test policy")
}

fn pipeline() -> Pipeline {
    pipeline_with(|_| {})
}

fn chat_headers(user: &str) -> Vec<Header<'_>> {
    vec![
        Header {
            name: ":method",
            value: b"POST",
        },
        Header {
            name: ":path",
            value: b"/v1/chat/completions",
        },
        Header {
            name: "content-type",
            value: b"application/json",
        },
        Header {
            name: "x-user-id",
            value: user.as_bytes(),
        },
    ]
}

/// A streamed chat request asking for `max_tokens` output tokens.
fn chat_body(max_tokens: u32) -> Vec<u8> {
    format!(
        r#"{{"model":"gpt-4o-mini","stream":true,"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hello there"}}]}}"#
    )
    .into_bytes()
}

/// Head and body of a request of `user` asking for `max_tokens`: the body's decision.
async fn submit<'a>(
    life: &'a mut RequestLife<'_>,
    user: &str,
    max_tokens: u32,
) -> BodyDecision<'a> {
    let now = Instant::now();
    let head = life
        .head(&chat_headers(user), false, now)
        .expect("in order");
    assert!(
        matches!(head, HeadDecision::Continue { .. }),
        "head: {head:?}"
    );
    life.body(chat_body(max_tokens), true, now)
        .await
        .expect("in order")
}

/// A request of alice admitted at once, with Envoy showing it the response body.
async fn admitted(pipeline: &Pipeline, max_tokens: u32) -> RequestLife<'_> {
    let mut life = RequestLife::new(pipeline);
    life.set_response_body_shown(true);
    let decision = submit(&mut life, TENANT, max_tokens).await;
    assert!(
        matches!(decision, BodyDecision::Admit(_)),
        "expected an admission, got {decision:?}"
    );
    life
}

/// Tokens alice has used this minute, and her live leases.
async fn budget(pipeline: &Pipeline) -> (u64, u32) {
    let policy = pipeline.rules.borrow().policy.clone();
    let tier = policy.tier_for(TENANT, policy.tier_named("free").unwrap());
    let windows = tier.windows_for("gpt-4o-mini");
    let usage = pipeline
        .ledger
        .usage(TENANT, &windows)
        .await
        .expect("the memory store answers");
    (usage.windows[0].used, usage.leases)
}

/// The sum of a metric's series whose labels include every one of `labels`.
fn metric(pipeline: &Pipeline, name: &str, labels: &[&str]) -> f64 {
    pipeline
        .metrics
        .render()
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn outcomes(pipeline: &Pipeline, outcome: &str) -> f64 {
    metric(
        pipeline,
        crate::observe::REQUESTS,
        &[&format!("outcome=\"{outcome}\"")],
    )
}

fn in_flight(pipeline: &Pipeline) -> u32 {
    pipeline.scheduler.load().in_flight
}

/// The tokens a test request reserves: its counted input plus the output it may generate.
async fn reservation_of(max_tokens: u32) -> u64 {
    let pipeline = pipeline();
    let _life = admitted(&pipeline, max_tokens).await;
    budget(&pipeline).await.0
}

const SSE: &[u8] = b"text/event-stream";

fn sse_token(text: &str) -> Vec<u8> {
    format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n")
        .into_bytes()
}

fn sse_usage(prompt: u64, completion: u64) -> Vec<u8> {
    format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion}}}}}\n\n"
    )
    .into_bytes()
}

#[tokio::test(start_paused = true)]
async fn a_complete_stream_is_settled_once_with_the_usage_it_reported() {
    let pipeline = pipeline();
    let mut life = admitted(&pipeline, 40).await;
    let (reserved, leases) = budget(&pipeline).await;
    assert_eq!(leases, 1);
    assert!(reserved > 40, "input plus the output asked for: {reserved}");
    assert_eq!(in_flight(&pipeline), 1);

    let headers = life.response_headers(200, Some(SSE), false).unwrap();
    assert!(
        headers
            .iter()
            .any(|(name, _)| *name == "x-ratelimit-remaining-tokens"),
        "the budgets' state goes back to the client: {headers:?}"
    );
    let now = Instant::now() + Duration::from_millis(250);
    life.response_body(&sse_token("hi"), false, now).unwrap();
    life.response_body(&sse_usage(7, 3), false, now).unwrap();
    life.response_body(b"data: [DONE]\n\n", true, now).unwrap();
    assert_eq!(
        in_flight(&pipeline),
        0,
        "the slot frees when the response ends"
    );
    life.finish().await;

    assert_eq!(
        budget(&pipeline).await,
        (10, 0),
        "settled to the usage: 7 + 3"
    );
    assert_eq!(outcomes(&pipeline, "admitted"), 1.0);
    assert_eq!(
        metric(&pipeline, crate::observe::STREAM_COMPLETIONS, &["complete"]),
        1.0
    );
    assert_eq!(
        metric(&pipeline, crate::observe::BUDGET_TOKENS, &["settled"]),
        10.0,
        "settled exactly once"
    );
    assert_eq!(metric(&pipeline, crate::observe::ACTIVE_LEASES, &[]), 0.0);
}

#[tokio::test(start_paused = true)]
async fn every_ending_of_an_admitted_request_settles_once_and_frees_its_slot() {
    let full = reservation_of(40).await;
    let input = full - 40;
    // (ending, what the response did, tokens charged at the end)
    struct Ending {
        name: &'static str,
        status: Option<u16>,
        chunks: &'static [&'static str],
        end: bool,
        charged: u64,
    }
    let table = [
        // The client (or Envoy, or a shutdown) ended the stream before any response: the
        // prompt may have been processed; nothing was generated.
        Ending {
            name: "client gone before the response",
            status: None,
            chunks: &[],
            end: false,
            charged: input,
        },
        // Truncated: two tokens streamed, no usage, no [DONE]; the stream ended (client gone,
        // Envoy timeout or tollgate shutting down all end it the same way).
        Ending {
            name: "truncated mid-stream",
            status: Some(200),
            chunks: &["a", "b"],
            end: false,
            charged: input + 2,
        },
        // The upstream failed: nothing is charged, the request's count is given back too.
        Ending {
            name: "upstream error",
            status: Some(503),
            chunks: &[],
            end: true,
            charged: 0,
        },
    ];
    for ending in table {
        let pipeline = pipeline();
        let mut life = admitted(&pipeline, 40).await;
        assert_eq!(budget(&pipeline).await, (full, 1), "{}", ending.name);
        let now = Instant::now();
        if let Some(status) = ending.status {
            life.response_headers(status, Some(SSE), false).unwrap();
            for text in ending.chunks {
                life.response_body(&sse_token(text), false, now).unwrap();
            }
            if ending.end {
                life.response_body(b"", true, now).unwrap();
            }
        }
        life.finish().await;
        assert_eq!(
            budget(&pipeline).await,
            (ending.charged, 0),
            "{}: charged, and the lease released",
            ending.name
        );
        assert_eq!(in_flight(&pipeline), 0, "{}: the slot is free", ending.name);
        assert_eq!(outcomes(&pipeline, "admitted"), 1.0, "{}", ending.name);
        assert_eq!(
            metric(&pipeline, crate::observe::BUDGET_TOKENS, &["settled"]),
            ending.charged as f64,
            "{}: settled exactly once",
            ending.name
        );
    }
}

#[tokio::test(start_paused = true)]
async fn without_the_response_body_the_reserved_output_is_charged() {
    let pipeline = pipeline();
    let mut life = RequestLife::new(&pipeline);
    life.set_response_body_shown(false);
    let decision = submit(&mut life, TENANT, 40).await;
    assert!(matches!(decision, BodyDecision::Admit(_)));
    let (reserved, _) = budget(&pipeline).await;
    life.response_headers(200, Some(SSE), false).unwrap();
    life.finish().await;
    assert_eq!(budget(&pipeline).await, (reserved, 0));
}

/// A second request of alice while the only slot is taken: it waits.
async fn queued<'p>(pipeline: &'p Pipeline) -> RequestLife<'p> {
    let mut life = RequestLife::new(pipeline);
    let decision = submit(&mut life, TENANT, 40).await;
    let BodyDecision::Wait { envoy_timeout } = decision else {
        panic!("expected a wait, got {decision:?}");
    };
    assert!(
        envoy_timeout > QUEUE_DEADLINE,
        "Envoy waits past the deadline"
    );
    assert_eq!(life.phase(), Phase::Queued);
    life
}

/// Alice's first request holds the only slot and her second waits for it; with what one of
/// them reserves.
async fn one_running_one_queued(pipeline: &Pipeline) -> (RequestLife<'_>, RequestLife<'_>, u64) {
    let first = admitted(pipeline, 40).await;
    let one = budget(pipeline).await.0;
    let second = queued(pipeline).await;
    (first, second, one)
}

/// A client that stays until `after`, then goes away.
async fn client_leaving_after(after: Duration) -> Option<()> {
    tokio::time::sleep(after).await;
    None
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_is_refused_at_its_deadline_and_gives_its_reservation_back() {
    let pipeline = pipeline();
    let (first, mut second, one) = one_running_one_queued(&pipeline).await;
    assert_eq!(budget(&pipeline).await, (2 * one, 2), "both reserved");

    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let enqueued = Instant::now();
    let waited = second
        .wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle,
        )
        .await
        .unwrap();
    assert_eq!(
        Instant::now().duration_since(enqueued),
        QUEUE_DEADLINE,
        "answered at the deadline, not a moment later"
    );
    let Waited::Refuse(reply) = waited else {
        panic!("expected a 503, got {waited:?}");
    };
    assert_eq!((reply.status(), reply.reason), (503, Reason::QueueTimeout));
    assert!(reply.all_headers().any(|h| h == ("retry-after", "1")));
    assert_eq!(
        budget(&pipeline).await,
        (one, 1),
        "the refused one took nothing"
    );
    second.finish().await;
    assert_eq!(
        budget(&pipeline).await,
        (one, 1),
        "and settles nothing more"
    );
    assert_eq!(outcomes(&pipeline, "shed"), 1.0);
    drop(first);
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_whose_client_leaves_takes_nothing() {
    let pipeline = pipeline();
    let (_first, mut second, one) = one_running_one_queued(&pipeline).await;
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let waited = second
        .wait(
            client_leaving_after(Duration::from_millis(300)),
            &mut lifecycle,
        )
        .await
        .unwrap();
    assert_eq!(waited, Waited::ClientGone);
    assert_eq!(budget(&pipeline).await, (one, 1));
    second.finish().await;
    assert_eq!(budget(&pipeline).await, (one, 1));
    assert_eq!(outcomes(&pipeline, "abandoned"), 1.0);
    assert_eq!(pipeline.scheduler.load().queued, 0, "its place is given up");
}

#[tokio::test(start_paused = true)]
async fn a_wait_given_up_by_its_caller_still_gives_the_reservation_back() {
    // The stream loop never drops a wait, but nothing stops a caller from doing so (a select,
    // an aborted task): the request stays queued, and `finish` refunds it.
    let pipeline = pipeline();
    let (_first, mut second, one) = one_running_one_queued(&pipeline).await;
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let given_up = tokio::time::timeout(
        Duration::from_millis(300),
        second.wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle,
        ),
    )
    .await;
    assert!(given_up.is_err(), "the wait was still on");
    assert_eq!(second.phase(), Phase::Queued);
    assert_eq!(budget(&pipeline).await, (2 * one, 2));
    second.finish().await;
    assert_eq!(budget(&pipeline).await, (one, 1), "refunded whole, once");
    assert_eq!(outcomes(&pipeline, "abandoned"), 1.0);
    assert_eq!(pipeline.scheduler.load().queued, 0, "its place is given up");
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_is_refused_when_the_server_drains() {
    let pipeline = pipeline();
    let (_first, mut second, one) = one_running_one_queued(&pipeline).await;
    let (lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let drain = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        lifecycle_tx.send(Lifecycle::Draining).unwrap();
    };
    let (waited, ()) = tokio::join!(
        second.wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle
        ),
        drain
    );
    let Waited::Refuse(reply) = waited.unwrap() else {
        panic!("expected a 503");
    };
    assert_eq!((reply.status(), reply.reason), (503, Reason::ShuttingDown));
    assert!(reply.all_headers().any(|h| h == ("retry-after", "1")));
    assert_eq!(budget(&pipeline).await, (one, 1));
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_gets_the_slot_the_first_one_frees() {
    let pipeline = pipeline();
    let mut first = admitted(&pipeline, 40).await;
    let mut second = queued(&pipeline).await;
    second.set_response_body_shown(true);
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let first_ends = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        first.response_headers(200, Some(SSE), false).unwrap();
        first
            .response_body(&sse_usage(7, 3), true, Instant::now())
            .unwrap();
        first.finish().await;
    };
    let (waited, ()) = tokio::join!(
        second.wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle
        ),
        first_ends
    );
    assert!(matches!(waited.unwrap(), Waited::Admit(_)));
    assert_eq!(second.phase(), Phase::Admitted);
    assert_eq!(in_flight(&pipeline), 1);
    second.finish().await;
    assert_eq!(in_flight(&pipeline), 0);
    assert_eq!(budget(&pipeline).await.1, 0);
    assert_eq!(
        metric(
            &pipeline,
            crate::observe::SCHEDULER_OUTCOMES,
            &["admitted_after_wait"]
        ),
        1.0
    );
}

/// One refusal per row: how the pipeline is set up, what the request asks for, and the
/// answer's status, reason and a header it must carry.
#[tokio::test(start_paused = true)]
async fn refusals_come_from_the_one_table() {
    struct Row {
        name: &'static str,
        edit: fn(&mut Config),
        /// Requests of alice admitted (and kept) before the one refused.
        before: usize,
        max_tokens: u32,
        status: u16,
        reason: Reason,
        header: &'static str,
    }
    let table = [
        Row {
            name: "token budget spent",
            edit: |c| {
                let free = c.tiers.get_mut("free").unwrap();
                (free.max_input_tokens, free.max_output_tokens) = (100, 100);
                free.tokens_per_minute = Some(200);
                c.scheduler.initial_limit = 4;
            },
            before: 1,
            max_tokens: 100,
            status: 429,
            reason: Reason::TokenBudgetExhausted,
            header: "retry-after",
        },
        Row {
            name: "concurrency limit",
            edit: |c| {
                c.tiers.get_mut("free").unwrap().max_concurrent = Some(1);
                c.scheduler.initial_limit = 4;
            },
            before: 1,
            max_tokens: 10,
            status: 429,
            reason: Reason::ConcurrencyLimitReached,
            header: "retry-after",
        },
        Row {
            name: "tenant's queue full",
            edit: |c| c.tiers.get_mut("free").unwrap().queue_max = 0,
            before: 1,
            max_tokens: 10,
            status: 503,
            reason: Reason::QueueFull,
            header: "retry-after",
        },
        Row {
            name: "over the output ceiling",
            edit: |_| {},
            before: 0,
            max_tokens: 1000,
            status: 400,
            reason: Reason::OutputTokensExceeded,
            header: "",
        },
    ];
    for row in table {
        let pipeline = pipeline_with(row.edit);
        let mut kept = Vec::new();
        for _ in 0..row.before {
            kept.push(admitted(&pipeline, row.max_tokens).await);
        }
        let taken = budget(&pipeline).await;
        let mut life = RequestLife::new(&pipeline);
        let decision = submit(&mut life, TENANT, row.max_tokens).await;
        let BodyDecision::Refuse(reply) = decision else {
            panic!("{}: expected a refusal, got {decision:?}", row.name);
        };
        assert_eq!(
            (reply.status(), reply.reason),
            (row.status, row.reason),
            "{}: {}",
            row.name,
            reply.message
        );
        assert_eq!(reply.status(), reply.reason.status(), "{}", row.name);
        if !row.header.is_empty() {
            assert!(
                reply.all_headers().any(|(name, _)| name == row.header),
                "{}: no {} in {:?}",
                row.name,
                row.header,
                reply.all_headers().collect::<Vec<_>>()
            );
        }
        assert_eq!(life.phase(), Phase::Refused, "{}", row.name);
        assert_eq!(
            budget(&pipeline).await,
            taken,
            "{}: a refused request consumes nothing",
            row.name
        );
        life.finish().await;
        assert_eq!(budget(&pipeline).await, taken, "{}", row.name);
        drop(kept);
    }
}

#[tokio::test(start_paused = true)]
async fn heads_are_refused_passed_through_or_continued() {
    let pipeline = pipeline();
    let now = Instant::now();

    let mut anonymous = RequestLife::new(&pipeline);
    let headers: Vec<Header<'_>> = chat_headers("")
        .into_iter()
        .filter(|h| h.name != "x-user-id")
        .collect();
    let HeadDecision::Refuse(reply) = anonymous.head(&headers, false, now).unwrap() else {
        panic!("no identity must be refused");
    };
    assert_eq!(
        (reply.status(), reply.reason),
        (401, Reason::MissingIdentity)
    );

    let mut models = RequestLife::new(&pipeline);
    let get = [
        Header {
            name: ":method",
            value: b"GET",
        },
        Header {
            name: ":path",
            value: b"/v1/models",
        },
    ];
    assert_eq!(
        models.head(&get, true, now).unwrap(),
        HeadDecision::PassThrough
    );
    assert_eq!(models.phase(), Phase::PassedThrough);
    assert!(
        models.body(b"x".to_vec(), true, now).await.unwrap() == BodyDecision::PassThrough,
        "a passed-through request's later phases are let through"
    );
    assert_eq!(outcomes(&pipeline, "passed_through"), 1.0);
}

#[tokio::test(start_paused = true)]
async fn phases_out_of_order_are_values_and_change_nothing() {
    let pipeline = pipeline();
    let now = Instant::now();
    let mut life = RequestLife::new(&pipeline);
    let wrong = life.body(chat_body(10), true, now).await.unwrap_err();
    assert_eq!(wrong.state, Phase::Start.describe());
    assert_eq!(life.phase(), Phase::Start);
    assert!(life.response_headers(200, None, false).is_err());
    assert!(life.request_trailers(now).is_err());

    life.head(&chat_headers(TENANT), false, now).unwrap();
    assert!(life.head(&chat_headers(TENANT), false, now).is_err());
    assert_eq!(life.phase(), Phase::AwaitingBody);
    // Trailers where the body should be: a request with no body.
    let TrailersDecision::Refuse(reply) = life.request_trailers(now).unwrap() else {
        panic!("trailers before a body must be refused");
    };
    assert_eq!(reply.reason, Reason::MissingBody);
    assert!(life.body(chat_body(10), true, now).await.is_err());
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let not_queued = life
        .wait(client_leaving_after(Duration::ZERO), &mut lifecycle)
        .await;
    assert_eq!(
        not_queued.unwrap_err().state,
        Phase::Refused.describe(),
        "only a queued request waits"
    );
    assert_eq!(life.phase(), Phase::Refused);
    assert_eq!(budget(&pipeline).await, (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_life_dropped_without_finishing_releases_its_lease_and_slot() {
    // A panic or an aborted task: nobody calls `finish`. The lease and the slot are still
    // released, once, and the reservation is charged as taken.
    let pipeline = pipeline();
    let life = admitted(&pipeline, 40).await;
    let (reserved, leases) = budget(&pipeline).await;
    assert_eq!(leases, 1);
    drop(life);
    assert_eq!(in_flight(&pipeline), 0);
    // The release is spawned (Drop cannot wait): let it run.
    tokio::task::yield_now().await;
    assert_eq!(budget(&pipeline).await, (reserved, 0));
}

#[tokio::test(start_paused = true)]
async fn a_response_before_the_body_is_envoys_own_answer() {
    let pipeline = pipeline();
    let now = Instant::now();
    let mut life = RequestLife::new(&pipeline);
    life.head(&chat_headers(TENANT), false, now).unwrap();
    assert_eq!(life.response_headers(413, None, false).unwrap(), &[]);
    assert_eq!(life.phase(), Phase::PassedThrough);
    life.response_body(b"too large", true, now).unwrap();
    life.finish().await;
    assert_eq!(outcomes(&pipeline, "answered_by_envoy"), 1.0);
    assert_eq!(budget(&pipeline).await, (0, 0));
}

#[test]
fn settlement_rules() {
    // The pure part of finishing: `spent_tokens`, by ending.
    let pipeline = pipeline();
    let policy = pipeline.rules.borrow().policy.clone();
    let head = InferenceHead {
        identity: request::Identity {
            tenant: TENANT.to_owned(),
            tier: policy.tier_named("free").unwrap(),
        },
        api: request::ApiKind::Chat,
        spoofed_headers: Vec::new(),
    };
    let BodyVerdict::Admit(admission) = admission::decide_body(&policy, &head, &chat_body(40))
    else {
        panic!("a valid body");
    };
    let input = u64::from(admission.input_tokens);
    let usage = Usage {
        prompt_tokens: 9,
        completion_tokens: 4,
    };
    let table = [
        (ResponseEnd::UpstreamError, Some(usage), true, (0, 0, true)),
        (ResponseEnd::Complete, Some(usage), true, (9, 4, false)),
        (ResponseEnd::Truncated, Some(usage), false, (9, 4, false)),
        (ResponseEnd::Complete, None, false, (input, 40, false)),
        (ResponseEnd::NoResponse, None, true, (input, 0, false)),
    ];
    for (end, usage, observed, (i, o, refund)) in table {
        let spent = spent_tokens(&admission, end, usage, None, observed);
        assert_eq!(
            spent,
            Spent {
                input: i,
                output: o,
                refund_request: refund
            },
            "{end:?} {usage:?} observed={observed}"
        );
    }
}

/// Shadow mode at each level (top, tier, tenant): what enforcement would refuse with a 429 or
/// 503 is counted and goes upstream, named in `x-tollgate-shadow-refusal`; what is wrong with
/// the request itself is still refused.
#[tokio::test(start_paused = true)]
async fn shadow_mode_counts_what_it_would_refuse_and_lets_it_through() {
    struct Row {
        name: &'static str,
        edit: fn(&mut Config),
        before: usize,
        max_tokens: u32,
        reason: Reason,
        /// Whether the request's reservation stands (granted, only its slot was refused).
        charged: bool,
    }
    let table = [
        Row {
            name: "token budget spent, shadow at the top",
            edit: |c| {
                c.enforce = false;
                let free = c.tiers.get_mut("free").unwrap();
                (free.max_input_tokens, free.max_output_tokens) = (100, 100);
                free.tokens_per_minute = Some(200);
                c.scheduler.initial_limit = 4;
            },
            before: 1,
            max_tokens: 100,
            reason: Reason::TokenBudgetExhausted,
            charged: false,
        },
        Row {
            name: "concurrency limit, shadow in the tier",
            edit: |c| {
                let free = c.tiers.get_mut("free").unwrap();
                free.max_concurrent = Some(1);
                free.enforce = Some(false);
                c.scheduler.initial_limit = 4;
            },
            before: 1,
            max_tokens: 10,
            reason: Reason::ConcurrencyLimitReached,
            charged: false,
        },
        Row {
            name: "queue full, shadow for the tenant over an enforcing top level",
            edit: |c| {
                c.tiers.get_mut("free").unwrap().queue_max = 0;
                c.tenants.insert(
                    TENANT.to_owned(),
                    crate::config::TierOverride {
                        enforce: Some(false),
                        ..Default::default()
                    },
                );
            },
            before: 1,
            max_tokens: 10,
            reason: Reason::QueueFull,
            charged: true,
        },
    ];
    for row in table {
        let pipeline = pipeline_with(row.edit);
        let mut kept = Vec::new();
        for _ in 0..row.before {
            kept.push(admitted(&pipeline, row.max_tokens).await);
        }
        let taken = budget(&pipeline).await;
        let mut life = RequestLife::new(&pipeline);
        let decision = submit(&mut life, TENANT, row.max_tokens).await;
        let BodyDecision::Admit(forward) = decision else {
            panic!("{}: expected it let through, got {decision:?}", row.name);
        };
        assert!(
            forward
                .headers
                .contains(&("x-tollgate-shadow-refusal", row.reason.as_str().to_owned())),
            "{}: {:?}",
            row.name,
            forward.headers
        );
        assert_eq!(life.phase(), Phase::Admitted, "{}", row.name);
        let shadow = metric(
            &pipeline,
            crate::observe::SHADOW_REFUSALS,
            &[&format!("reason=\"{}\"", row.reason.as_str())],
        );
        assert_eq!(shadow, 1.0, "{}", row.name);
        assert_eq!(
            metric(&pipeline, crate::observe::REJECTIONS, &[]),
            0.0,
            "{}",
            row.name
        );
        let (tokens, leases) = budget(&pipeline).await;
        if row.charged {
            assert!(tokens > taken.0, "{}: reserved as usual", row.name);
        } else {
            assert_eq!(
                (tokens, leases),
                taken,
                "{}: refused, so nothing reserved",
                row.name
            );
        }
        assert_eq!(
            in_flight(&pipeline),
            row.before as u32,
            "{}: let through without a slot",
            row.name
        );
        life.finish().await;
        drop(kept);
    }

    // Shadow mode does not rehearse checks of the request itself.
    let pipeline = pipeline_with(|c| c.enforce = false);
    let mut life = RequestLife::new(&pipeline);
    let decision = submit(&mut life, TENANT, 1000).await;
    let BodyDecision::Refuse(reply) = decision else {
        panic!("expected a refusal, got {decision:?}");
    };
    assert_eq!(reply.reason, Reason::OutputTokensExceeded);
}

#[tokio::test(start_paused = true)]
async fn in_shadow_mode_a_request_past_its_queue_deadline_goes_upstream_without_a_slot() {
    let pipeline = pipeline_with(|c| c.enforce = false);
    let (first, mut second, one) = one_running_one_queued(&pipeline).await;
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let enqueued = Instant::now();
    let waited = second
        .wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle,
        )
        .await
        .unwrap();
    assert_eq!(Instant::now().duration_since(enqueued), QUEUE_DEADLINE);
    let Waited::Admit(forward) = waited else {
        panic!("expected it let through, got {waited:?}");
    };
    assert!(
        forward
            .headers
            .contains(&("x-tollgate-shadow-refusal", "queue_timeout".to_owned()))
    );
    assert_eq!(in_flight(&pipeline), 1, "only the first holds a slot");
    assert_eq!(
        budget(&pipeline).await,
        (2 * one, 2),
        "both reserved as usual"
    );
    second.finish().await;
    assert_eq!(budget(&pipeline).await.1, 1, "settled at its end");
    drop(first);
}

/// A reload replaces the policy for requests that begin after it; one already queued keeps the
/// rules it was admitted under (here, its queue deadline).
#[tokio::test(start_paused = true)]
async fn a_request_keeps_the_policy_it_began_under() {
    let (pipeline, rules) = pipeline_and_rules(|_| {});
    let (first, mut second, _) = one_running_one_queued(&pipeline).await;

    let mut reloaded = Config {
        default_tier: "free".to_owned(),
        ..Config::default()
    };
    reloaded.tiers = BTreeMap::from([(
        "free".to_owned(),
        TierConfig {
            max_input_tokens: 1000,
            max_output_tokens: 100,
            queue_max: 2,
            queue_deadline_ms: 5_000,
            ..TierConfig::default()
        },
    )]);
    reloaded.scheduler.initial_limit = 1;
    let policy = Arc::new(test_policy(&reloaded));
    rules.send_replace(Rules::new(policy, &pipeline.metrics));

    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let enqueued = Instant::now();
    let waited = second
        .wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle,
        )
        .await
        .unwrap();
    assert!(matches!(waited, Waited::Refuse(_)), "{waited:?}");
    assert_eq!(
        Instant::now().duration_since(enqueued),
        QUEUE_DEADLINE,
        "the deadline it was queued under"
    );
    second.finish().await;

    let mut third = queued(&pipeline).await;
    let enqueued = Instant::now();
    let waited = third
        .wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle,
        )
        .await
        .unwrap();
    assert!(matches!(waited, Waited::Refuse(_)), "{waited:?}");
    assert_eq!(
        Instant::now().duration_since(enqueued),
        Duration::from_secs(5),
        "a request after the reload waits as long as the new policy says"
    );
    third.finish().await;
    drop(first);
}

// ---------------------------------------------------------------------------------------------
// Responses reported on (`reports`)

/// A streamed response's summary: complete, with a body and the upstream's usage (10 tokens).
fn complete_summary() -> Summary {
    Summary {
        status: 200,
        usage: Some(Usage {
            prompt_tokens: 7,
            completion_tokens: 3,
        }),
        finished: true,
        body_bytes: 120,
    }
}

/// A request of alice admitted with its response reported on; its report tag.
async fn admitted_with_reports(pipeline: &Pipeline, max_tokens: u32) -> (RequestLife<'_>, String) {
    let mut life = RequestLife::new(pipeline);
    life.set_response_body_shown(false);
    life.expect_reports();
    let tag = match submit(&mut life, TENANT, max_tokens).await {
        BodyDecision::Admit(forward) => forward.report_tag.expect("a tag").to_owned(),
        other => panic!("expected an admission, got {other:?}"),
    };
    (life, tag)
}

fn reports_counted(pipeline: &Pipeline, report: &str, outcome: &str) -> f64 {
    metric(
        pipeline,
        crate::observe::RESPONSE_REPORTS,
        &[
            &format!("report=\"{report}\""),
            &format!("outcome=\"{outcome}\""),
        ],
    )
}

#[tokio::test(start_paused = true)]
async fn a_reported_response_is_timed_by_its_first_token_and_settled_by_its_summary() {
    let pipeline = pipeline();
    let (mut life, tag) = admitted_with_reports(&pipeline, 40).await;
    assert_eq!(in_flight(&pipeline), 1);
    assert_eq!(pipeline.reports.open_count(), 1);
    life.response_headers(200, Some(SSE), false).unwrap();

    let first = Instant::now() + Duration::from_millis(300);
    let report = |tag: Option<&str>| {
        pipeline
            .reports
            .first_token(&pipeline.metrics, &pipeline.ttft_window, tag, first)
    };
    assert_eq!(report(Some(&tag)), ReportOutcome::Matched);
    assert_eq!(report(Some(&tag)), ReportOutcome::Unknown, "once only");
    assert_eq!(
        metric(&pipeline, &format!("{}_count", crate::observe::TTFT), &[]),
        1.0,
        "timed from the report"
    );
    assert_eq!(
        window::lock(&pipeline.ttft_window).count(first),
        1,
        "in the controller's window"
    );

    let summary = complete_summary();
    // The summary may come before the request's own stream ends, or after: it waits.
    assert_eq!(
        pipeline
            .reports
            .summary(&pipeline.metrics, Some(&tag), summary),
        ReportOutcome::Matched
    );
    life.finish().await;
    assert_eq!(in_flight(&pipeline), 0);
    assert_eq!(budget(&pipeline).await, (10, 0), "settled to the usage");
    assert_eq!(
        metric(&pipeline, crate::observe::STREAM_COMPLETIONS, &["complete"]),
        1.0
    );
    assert_eq!(pipeline.reports.open_count(), 0);
    assert_eq!(reports_counted(&pipeline, "first_token", "missing"), 0.0);
    assert_eq!(
        pipeline
            .reports
            .summary(&pipeline.metrics, Some(&tag), summary),
        ReportOutcome::Unknown,
        "a repeat changes nothing"
    );
    assert_eq!(budget(&pipeline).await, (10, 0));
}

#[tokio::test(start_paused = true)]
async fn a_summary_that_comes_after_the_request_ended_still_settles_it() {
    let pipeline = pipeline();
    let (mut life, tag) = admitted_with_reports(&pipeline, 40).await;
    life.response_headers(200, Some(SSE), false).unwrap();
    let summary = complete_summary();
    // The request's stream ends first; Envoy's access log comes 150 ms later.
    let report = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(in_flight(&pipeline), 0, "the slot was freed at the end");
        pipeline
            .reports
            .summary(&pipeline.metrics, Some(&tag), summary)
    };
    let ((), outcome) = tokio::join!(life.finish(), report);
    assert_eq!(outcome, ReportOutcome::Matched);
    assert_eq!(budget(&pipeline).await, (10, 0), "settled to the usage");
}

/// The summary of a response with a body, reported before the request's end.
fn summary_with_body(pipeline: &Pipeline, tag: &str) {
    let summary = complete_summary();
    assert_eq!(
        pipeline
            .reports
            .summary(&pipeline.metrics, Some(tag), summary),
        ReportOutcome::Matched
    );
}

/// How many first tokens the controller's window still waits for, seen from `at`.
fn pending_in_window(pipeline: &Pipeline, at: Instant) -> u64 {
    let mut window = window::lock(&pipeline.ttft_window);
    let (_, counted) = window.quantile_counting_overdue(at, 0.99, Duration::from_millis(1));
    counted - window.count(at)
}

#[tokio::test(start_paused = true)]
async fn a_first_token_overtaken_by_its_summary_is_still_recorded_after_the_settlement() {
    let pipeline = pipeline();
    // As the shipped file has it: the request's stream is shown no response headers.
    let (life, tag) = admitted_with_reports(&pipeline, 40).await;
    // A short body: its end, and so its summary, reach tollgate before its first token.
    summary_with_body(&pipeline, &tag);
    let started = Instant::now();
    life.finish().await;
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no wait for the first token"
    );
    assert_eq!(budget(&pipeline).await, (10, 0), "settled to the usage");
    assert_eq!(pipeline.reports.open_count(), 1, "open to its first token");
    let later = Instant::now() + Duration::from_secs(1);
    assert_eq!(
        pending_in_window(&pipeline, later),
        0,
        "the response is over"
    );

    tokio::time::sleep(Duration::from_millis(5)).await;
    let now = Instant::now();
    let outcome =
        pipeline
            .reports
            .first_token(&pipeline.metrics, &pipeline.ttft_window, Some(&tag), now);
    assert_eq!(outcome, ReportOutcome::Matched);
    assert_eq!(
        metric(&pipeline, &format!("{}_count", crate::observe::TTFT), &[]),
        1.0
    );
    assert_eq!(
        window::lock(&pipeline.ttft_window).count(now),
        1,
        "its sample in the controller's window"
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(pipeline.reports.open_count(), 0, "closed once it came");
    assert_eq!(reports_counted(&pipeline, "first_token", "missing"), 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_first_token_that_never_comes_is_given_up_at_the_deadline() {
    let pipeline = pipeline();
    let (life, tag) = admitted_with_reports(&pipeline, 40).await;
    summary_with_body(&pipeline, &tag);
    let deadline = Instant::now() + pipeline.rules.borrow().policy.summary_wait;
    life.finish().await;
    assert_eq!(budget(&pipeline).await, (10, 0), "settled without it");
    tokio::time::sleep_until(deadline - Duration::from_millis(1)).await;
    assert_eq!(pipeline.reports.open_count(), 1);
    assert_eq!(pending_in_window(&pipeline, Instant::now()), 0);
    tokio::time::sleep_until(deadline + Duration::from_millis(1)).await;
    assert_eq!(pipeline.reports.open_count(), 0);
    assert_eq!(reports_counted(&pipeline, "first_token", "missing"), 1.0);
    let outcome = pipeline.reports.first_token(
        &pipeline.metrics,
        &pipeline.ttft_window,
        Some(&tag),
        Instant::now(),
    );
    assert_eq!(outcome, ReportOutcome::Unknown, "too late");
}

#[tokio::test(start_paused = true)]
async fn a_response_without_a_body_closes_at_its_summary() {
    let pipeline = pipeline();
    let (life, tag) = admitted_with_reports(&pipeline, 40).await;
    let summary = Summary {
        status: 200,
        usage: None,
        finished: false,
        body_bytes: 0,
    };
    assert_eq!(
        pipeline
            .reports
            .summary(&pipeline.metrics, Some(&tag), summary),
        ReportOutcome::Matched
    );
    let started = Instant::now();
    life.finish().await;
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no first token to wait for"
    );
    assert_eq!(reports_counted(&pipeline, "first_token", "missing"), 1.0);
    assert_eq!(pipeline.reports.open_count(), 0);
}

#[tokio::test(start_paused = true)]
async fn without_a_summary_the_reserved_output_is_charged_after_the_wait() {
    let pipeline = pipeline();
    let (mut life, tag) = admitted_with_reports(&pipeline, 40).await;
    let (reserved, _) = budget(&pipeline).await;
    life.response_headers(200, Some(SSE), false).unwrap();
    let started = Instant::now();
    life.finish().await;
    let wait = pipeline.rules.borrow().policy.summary_wait;
    assert_eq!(
        started.elapsed(),
        wait,
        "waited response.summary_wait_ms, no longer"
    );
    assert_eq!(budget(&pipeline).await, (reserved, 0));
    assert_eq!(reports_counted(&pipeline, "summary", "missing"), 1.0);
    assert_eq!(reports_counted(&pipeline, "first_token", "missing"), 1.0);
    assert_eq!(
        metric(
            &pipeline,
            crate::observe::STREAM_COMPLETIONS,
            &["truncated"]
        ),
        1.0,
        "an end nobody reported cannot count as complete"
    );
    // The report that comes later finds nobody.
    let late = Summary {
        status: 200,
        usage: None,
        finished: true,
        body_bytes: 200,
    };
    assert_eq!(
        pipeline
            .reports
            .summary(&pipeline.metrics, Some(&tag), late),
        ReportOutcome::Unknown
    );
}

#[tokio::test(start_paused = true)]
async fn reports_for_nobody_here_change_nothing() {
    let pipeline = pipeline();
    let (life, tag) = admitted_with_reports(&pipeline, 40).await;
    let (reserved, leases) = budget(&pipeline).await;
    let id = tag.rsplit_once('.').unwrap().1;
    let elsewhere = format!("another-replica.{id}");
    let summary = Summary {
        status: 200,
        usage: None,
        finished: true,
        body_bytes: 200,
    };
    let now = Instant::now();
    let reports = &pipeline.reports;
    let metrics = &pipeline.metrics;
    let window = &pipeline.ttft_window;
    for (tag, outcome) in [
        (Some(elsewhere.as_str()), ReportOutcome::OtherReplica),
        (None, ReportOutcome::Untagged),
        (Some("no dot"), ReportOutcome::Untagged),
        (Some("test-replica.x"), ReportOutcome::Untagged),
        (Some("test-replica.999"), ReportOutcome::Unknown),
    ] {
        assert_eq!(reports.summary(metrics, tag, summary), outcome, "{tag:?}");
        assert_eq!(
            reports.first_token(metrics, window, tag, now),
            outcome,
            "{tag:?}"
        );
    }
    assert_eq!(budget(&pipeline).await, (reserved, leases));
    assert_eq!(
        metric(&pipeline, &format!("{}_count", crate::observe::TTFT), &[]),
        0.0
    );
    drop(life);
}

#[test]
fn how_a_reported_response_ended() {
    let usage = Usage {
        prompt_tokens: 9,
        completion_tokens: 4,
    };
    let summary = |status, usage, finished| {
        Some(Summary {
            status,
            usage,
            finished,
            body_bytes: 200,
        })
    };
    let ok = ResponseObserver::new(200, Some(SSE), 1024);
    let failed = ResponseObserver::new(503, Some(SSE), 1024);
    let (complete, truncated) = (ResponseEnd::Complete, ResponseEnd::Truncated);
    let table = [
        (
            Some(&ok),
            summary(200, Some(usage), true),
            complete,
            Some(usage),
        ),
        // A proper end without usage: complete; the output is charged as reserved.
        (Some(&ok), summary(200, None, true), complete, None),
        // Cut off after the usage chunk: truncated, and the usage is what it cost.
        (
            Some(&ok),
            summary(200, Some(usage), false),
            truncated,
            Some(usage),
        ),
        (Some(&ok), summary(200, None, false), truncated, None),
        // After the upstream's 200, a reset Envoy answered the client itself: truncated, as
        // on the streamed path, not the upstream's error.
        (Some(&ok), summary(502, None, false), truncated, None),
        (
            Some(&failed),
            summary(200, Some(usage), true),
            ResponseEnd::UpstreamError,
            None,
        ),
        (Some(&failed), None, ResponseEnd::UpstreamError, None),
        // The client left before any response.
        (None, summary(0, None, false), ResponseEnd::NoResponse, None),
        (None, None, ResponseEnd::NoResponse, None),
        // No response headers on the request's stream: the summary's status stands in.
        (
            None,
            summary(503, None, false),
            ResponseEnd::UpstreamError,
            None,
        ),
        (None, summary(200, Some(usage), true), complete, Some(usage)),
        // No summary came: the end is unknown, and cannot count as complete.
        (Some(&ok), None, truncated, None),
    ];
    for (seen, summary, end, charged) in table {
        assert_eq!(
            reported_end(seen, summary),
            (end, charged),
            "{:?} {summary:?}",
            seen.map(ResponseObserver::end)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_reported_life_dropped_without_finishing_closes_its_registration() {
    let pipeline = pipeline();
    let (life, tag) = admitted_with_reports(&pipeline, 40).await;
    assert_eq!(pipeline.reports.open_count(), 1);
    // A panic mid-request drops the life without `finish`: no entry may outlive it (its
    // pending first token would read as an ever slower request).
    drop(life);
    assert_eq!(pipeline.reports.open_count(), 0);
    assert_eq!(reports_counted(&pipeline, "first_token", "missing"), 1.0);
    // Nothing left pending in the controller's window: no overdue request counted.
    let later = Instant::now() + Duration::from_secs(5);
    let mut window = window::lock(&pipeline.ttft_window);
    let (_, counted) = window.quantile_counting_overdue(later, 0.99, Duration::from_millis(1));
    assert_eq!(counted, window.count(later), "no pending first token left");
    drop(window);
    let now = Instant::now();
    let outcome =
        pipeline
            .reports
            .first_token(&pipeline.metrics, &pipeline.ttft_window, Some(&tag), now);
    assert_eq!(outcome, ReportOutcome::Unknown);
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_reported_on_is_tagged_when_it_gets_its_slot() {
    let pipeline = pipeline();
    let (first, _) = admitted_with_reports(&pipeline, 40).await;
    let mut second = RequestLife::new(&pipeline);
    second.set_response_body_shown(false);
    second.expect_reports();
    let decision = submit(&mut second, TENANT, 40).await;
    assert!(
        matches!(decision, BodyDecision::Wait { .. }),
        "{decision:?}"
    );
    assert_eq!(
        pipeline.reports.open_count(),
        1,
        "a queued request is not open to reports yet"
    );
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let first_ends = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        first.finish().await;
    };
    let (waited, ()) = tokio::join!(
        second.wait(
            client_leaving_after(Duration::from_secs(60)),
            &mut lifecycle
        ),
        first_ends
    );
    match waited.unwrap() {
        Waited::Admit(forward) => assert!(forward.report_tag.is_some(), "tagged on admission"),
        other => panic!("expected an admission, got {other:?}"),
    }
    assert_eq!(
        pipeline.reports.open_count(),
        1,
        "the first closed, the second opened"
    );
    second.finish().await;
    assert_eq!(pipeline.reports.open_count(), 0);
    assert_eq!(in_flight(&pipeline), 0);
}

/// A chat request whose one message is `content`.
fn chat_body_saying(content: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"gpt-4o-mini","max_tokens":10,"messages":[{{"role":"user","content":"{content}"}}]}}"#
    )
    .into_bytes()
}

/// A chat request whose one message is at least `bytes` long: over `INLINE_BODY_BYTES`, it is
/// counted on a large body's thread.
fn chat_body_of_size(bytes: usize) -> Vec<u8> {
    chat_body_saying(&"lorem ipsum dolor sit amet ".repeat(bytes / 27 + 1))
}

/// One large body's thread, a wait of 200 ms for it, four slots, and a tier that admits large
/// prompts; then `edit`.
fn large_body_pipeline_with(edit: impl FnOnce(&mut Config)) -> Pipeline {
    pipeline_with(|c| {
        c.tokens.large_body_threads = 1;
        c.tokens.large_body_max_wait_ms = 200;
        c.scheduler.initial_limit = 4;
        let free = c.tiers.get_mut("free").unwrap();
        free.max_input_tokens = 1_000_000;
        free.tokens_per_minute = Some(10_000_000);
        edit(c);
    })
}

fn large_body_pipeline() -> Pipeline {
    large_body_pipeline_with(|_| {})
}

/// The only large body's thread, taken as another large body's count would take it.
fn hold_the_only_thread(pipeline: &Pipeline) -> tokio::sync::OwnedSemaphorePermit {
    Arc::clone(&pipeline.large_body_threads)
        .try_acquire_owned()
        .expect("the thread is free")
}

/// Large bodies waiting for a thread now (`tollgate_large_bodies_waiting`).
fn large_bodies_waiting(pipeline: &Pipeline) -> f64 {
    metric(pipeline, crate::observe::LARGE_BODIES_WAITING, &[])
}

/// Sends a large body as alice while another large body holds the only thread for `held`: its
/// decision, and how long it took.
async fn large_body_behind_a_busy_thread<'a>(
    life: &'a mut RequestLife<'_>,
    pipeline: &Pipeline,
    held: Duration,
) -> (BodyDecision<'a>, Duration) {
    let busy = hold_the_only_thread(pipeline);
    let freed = async {
        tokio::time::sleep(held).await;
        drop(busy);
    };
    let large = chat_body_of_size(INLINE_BODY_BYTES + 1);
    let (decided, ()) = tokio::join!(submit_body(life, large), freed);
    decided
}

/// Sends a head and `body` as alice, the body having arrived `ago`: the body's decision, and
/// how long it took from now.
async fn submit_body_arrived<'a>(
    life: &'a mut RequestLife<'_>,
    body: Vec<u8>,
    ago: Duration,
) -> (BodyDecision<'a>, Duration) {
    let now = Instant::now();
    let head = life
        .head(&chat_headers(TENANT), false, now - ago)
        .expect("in order");
    assert!(matches!(head, HeadDecision::Continue { .. }), "{head:?}");
    let decision = life.body(body, true, now - ago).await.expect("in order");
    (decision, Instant::now().duration_since(now))
}

/// Sends a head and `body` as alice: the body's decision, and how long it took.
async fn submit_body<'a>(
    life: &'a mut RequestLife<'_>,
    body: Vec<u8>,
) -> (BodyDecision<'a>, Duration) {
    submit_body_arrived(life, body, Duration::ZERO).await
}

#[tokio::test(start_paused = true)]
async fn a_large_body_that_cannot_start_counting_in_time_is_refused_and_takes_nothing() {
    let pipeline = large_body_pipeline();
    let large = chat_body_of_size(INLINE_BODY_BYTES + 1);
    // Another large body holds the only thread.
    let busy = hold_the_only_thread(&pipeline);

    let mut life = RequestLife::new(&pipeline);
    let (decision, took) = submit_body(&mut life, large.clone()).await;
    let BodyDecision::Refuse(reply) = decision else {
        panic!("expected a 503, got {decision:?}");
    };
    assert_eq!(
        (reply.status(), reply.reason),
        (503, Reason::CountingBacklog)
    );
    assert!(reply.all_headers().any(|h| h == ("retry-after", "1")));
    assert_eq!(
        took,
        Duration::from_millis(200),
        "refused at the wait's end"
    );
    life.finish().await;
    assert_eq!(budget(&pipeline).await, (0, 0), "nothing reserved");
    assert_eq!(in_flight(&pipeline), 0, "no slot taken");
    assert_eq!(outcomes(&pipeline, "shed"), 1.0);
    assert_eq!(large_bodies_waiting(&pipeline), 0.0, "no longer waiting");

    // The wait is measured from the body's arrival, not from when it began waiting.
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) =
        submit_body_arrived(&mut life, large.clone(), Duration::from_millis(150)).await;
    assert!(matches!(decision, BodyDecision::Refuse(_)), "{decision:?}");
    assert_eq!(took, Duration::from_millis(50));
    drop(life);

    // A small body does not wait for the large bodies' threads.
    let small = admitted(&pipeline, 10).await;
    drop(small);

    // Once the thread is free, a body that arrived longer ago than the wait is refused all the
    // same, at once, and the same body just arrived is counted and admitted at once.
    drop(busy);
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) =
        submit_body_arrived(&mut life, large.clone(), Duration::from_millis(250)).await;
    let BodyDecision::Refuse(reply) = decision else {
        panic!("expected a 503, got {decision:?}");
    };
    assert_eq!(
        (reply.reason, took),
        (Reason::CountingBacklog, Duration::ZERO)
    );
    drop(life);
    assert_eq!(pipeline.large_body_threads.available_permits(), 1);
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) = submit_body(&mut life, large).await;
    assert!(matches!(decision, BodyDecision::Admit(_)), "{decision:?}");
    assert_eq!(took, Duration::ZERO);
    assert_eq!(
        pipeline.large_body_threads.available_permits(),
        1,
        "given back"
    );
}

#[tokio::test(start_paused = true)]
async fn large_bodies_waiting_for_a_thread_are_counted_when_it_frees_within_their_wait() {
    let pipeline = large_body_pipeline();
    let busy = hold_the_only_thread(&pipeline);
    let (mut first, mut second) = (RequestLife::new(&pipeline), RequestLife::new(&pipeline));
    let both = async {
        tokio::join!(
            submit_body(&mut first, chat_body_of_size(INLINE_BODY_BYTES + 1)),
            submit_body(&mut second, chat_body_of_size(2 * INLINE_BODY_BYTES)),
        )
    };
    let freed = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            large_bodies_waiting(&pipeline),
            2.0,
            "both wait for the one thread"
        );
        drop(busy);
    };
    let (((first_decision, first_took), (second_decision, second_took)), ()) =
        tokio::join!(both, freed);
    assert!(
        matches!(first_decision, BodyDecision::Admit(_)),
        "{first_decision:?}"
    );
    assert!(
        matches!(second_decision, BodyDecision::Admit(_)),
        "{second_decision:?}"
    );
    // Counting takes no time on the paused clock: each was decided when the thread freed.
    assert_eq!(first_took, Duration::from_millis(150));
    assert_eq!(second_took, Duration::from_millis(150));
    assert_eq!(large_bodies_waiting(&pipeline), 0.0);
    assert_eq!(pipeline.large_body_threads.available_permits(), 1);
    assert_eq!(in_flight(&pipeline), 2);
}

/// Bodies sent to the counting threads, by `reason` (`tollgate_bodies_counted_off_workers_total`).
fn counted_off_workers(pipeline: &Pipeline, reason: &str) -> f64 {
    metric(
        pipeline,
        crate::observe::BODIES_COUNTED_OFF_WORKERS,
        &[&format!("reason=\"{reason}\"")],
    )
}

#[tokio::test(start_paused = true)]
async fn a_small_body_of_text_costly_to_count_is_counted_off_the_workers() {
    let pipeline = large_body_pipeline();
    let busy = hold_the_only_thread(&pipeline);
    // Ordinary text under the inline size: decided on the worker, the thread busy or not.
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) = submit_body(&mut life, chat_body_of_size(INLINE_BODY_BYTES / 2)).await;
    assert!(matches!(decision, BodyDecision::Admit(_)), "{decision:?}");
    assert_eq!(took, Duration::ZERO);
    drop(life);
    assert_eq!(counted_off_workers(&pipeline, "costly_text"), 0.0);

    // A run of dashes a quarter the size: it waits for the busy thread, and is refused at its
    // wait's end as a large body would be.
    let dashes = "-".repeat(INLINE_BODY_BYTES / 4);
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) = submit_body(&mut life, chat_body_saying(&dashes)).await;
    let BodyDecision::Refuse(reply) = decision else {
        panic!("expected a 503, got {decision:?}");
    };
    assert_eq!(reply.reason, Reason::CountingBacklog);
    assert_eq!(took, Duration::from_millis(200));
    drop(life);
    assert_eq!(counted_off_workers(&pipeline, "costly_text"), 1.0);

    // With the thread free it is counted there, exactly.
    drop(busy);
    let mut life = RequestLife::new(&pipeline);
    let (decision, _) = submit_body(&mut life, chat_body_saying(&dashes)).await;
    let BodyDecision::Admit(forward) = decision else {
        panic!("expected it admitted, got {decision:?}");
    };
    let counted = tokens::Encoding::O200kBase.count(&dashes) as u64;
    let input = forward
        .headers
        .iter()
        .find(|(name, _)| *name == "x-tollgate-input-tokens")
        .map(|(_, value)| value.parse::<u64>().unwrap());
    // The chat's framing adds its tokens around the message's.
    assert!(
        input.is_some_and(|input| input > counted && input < counted + 16),
        "{input:?} against {counted} for the text alone"
    );
    assert_eq!(counted_off_workers(&pipeline, "costly_text"), 2.0);
    assert_eq!(
        counted_off_workers(&pipeline, "size"),
        0.0,
        "none was over the inline size"
    );
}

#[test]
fn large_bodies_are_counted_by_the_threads_set_or_one_per_worker_and_at_least_two() {
    // (tokens.large_body_threads, the runtime's workers, permits)
    let table = [
        (0, 2, 2),
        (0, 16, 16),
        (0, 1, 2),
        (0, 0, 2),
        (3, 2, 3),
        (1, 16, 1),
        (512, 2, 512),
        (0, 600, 512),
    ];
    for (setting, workers, permits) in table {
        assert_eq!(
            large_body_permits(setting, workers),
            permits,
            "{setting} with {workers} workers"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn in_shadow_mode_a_large_body_waits_its_turn_and_goes_upstream_unreserved() {
    let pipeline = large_body_pipeline_with(|c| c.enforce = false);
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) =
        large_body_behind_a_busy_thread(&mut life, &pipeline, Duration::from_millis(300)).await;
    assert_eq!(
        took,
        Duration::from_millis(300),
        "waited past its 200 ms for the thread"
    );
    let BodyDecision::Admit(forward) = decision else {
        panic!("expected it let through, got {decision:?}");
    };
    assert!(
        forward
            .headers
            .contains(&("x-tollgate-shadow-refusal", "counting_backlog".to_owned()))
    );
    assert_eq!(
        metric(
            &pipeline,
            crate::observe::SHADOW_REFUSALS,
            &["reason=\"counting_backlog\""]
        ),
        1.0
    );
    assert_eq!(
        budget(&pipeline).await,
        (0, 0),
        "nothing reserved, as enforcement"
    );
    assert_eq!(in_flight(&pipeline), 0, "and no slot");
    assert_eq!(pipeline.large_body_threads.available_permits(), 1);
    life.finish().await;
    assert_eq!(budget(&pipeline).await, (0, 0));
    // One outcome, and no refusal counted.
    assert_eq!(outcomes(&pipeline, "admitted"), 1.0);
    assert_eq!(outcomes(&pipeline, "shed"), 0.0);
    assert_eq!(
        metric(
            &pipeline,
            crate::observe::REJECTIONS,
            &["reason=\"counting_backlog\""]
        ),
        0.0
    );
}

#[tokio::test]
async fn a_large_body_keeps_its_thread_until_its_count_ends_though_its_request_is_gone() {
    // Real time: a count takes real time, which the paused clock would not let pass.
    let pipeline = large_body_pipeline();
    let threads = &pipeline.large_body_threads;
    // 4 MiB of made-up words: a count of hundreds of milliseconds, where the checks below take
    // microseconds.
    let body = chat_body_saying(&tollgate_testkit::text::made_up_words(4 << 20));
    let mut life = RequestLife::new(&pipeline);
    {
        let decided = submit_body(&mut life, body);
        tokio::pin!(decided);
        // Polled once: the thread is free, so its count takes it and starts. Then dropped, as
        // a stream that ends is.
        tokio::select! {
            biased;
            (decision, _) = &mut decided => panic!("decided at once: {decision:?}"),
            () = std::future::ready(()) => {}
        }
    }
    drop(life);
    assert_eq!(threads.available_permits(), 0, "still counting");
    let freed = async {
        while threads.available_permits() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), freed)
        .await
        .expect("the thread is given back when the count ends");
    assert_eq!(budget(&pipeline).await, (0, 0), "nothing reserved");
}

#[tokio::test(start_paused = true)]
async fn a_large_body_queued_after_its_count_is_timed_in_the_queue_from_joining_it() {
    let pipeline = large_body_pipeline_with(|c| {
        c.tokens.large_body_max_wait_ms = 500;
        c.scheduler.initial_limit = 1;
    });
    // The only slot is taken, and, for 300 ms, the only large body's thread.
    let running = admitted(&pipeline, 10).await;
    let mut life = RequestLife::new(&pipeline);
    let (decision, took) =
        large_body_behind_a_busy_thread(&mut life, &pipeline, Duration::from_millis(300)).await;
    assert!(
        matches!(decision, BodyDecision::Wait { .. }),
        "{decision:?}"
    );
    assert_eq!(took, Duration::from_millis(300));
    let (_lifecycle_tx, mut lifecycle) = watch::channel(Lifecycle::Serving);
    let waited = life.wait(
        client_leaving_after(Duration::from_secs(60)),
        &mut lifecycle,
    );
    let slot_freed = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        running.finish().await;
    };
    let (waited, ()) = tokio::join!(waited, slot_freed);
    let waited = waited.unwrap();
    assert!(matches!(waited, Waited::Admit(_)), "{waited:?}");
    let sum = |name: &str| metric(&pipeline, &format!("{name}_sum"), &[]);
    let queue_wait = sum(crate::observe::QUEUE_WAIT);
    assert!(
        (queue_wait - 0.2).abs() < 1e-9,
        "the queue's 200 ms, not the wait for the count's thread: {queue_wait}"
    );
    // Decisions are timed from the body's arrival: this one's 500 ms, the first one's none.
    let decisions = sum(crate::observe::DECISION_DURATION);
    assert!((decisions - 0.5).abs() < 1e-9, "{decisions}");
}
