use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::rc::Rc;

use super::*;

/// Deep enough that no test hits it unless it means to.
const DEEP: u32 = 1_000_000;

fn class(weight: u32) -> FlowClass {
    FlowClass {
        weight,
        band: 0,
        queue_max: DEEP,
        reserved_slots: 0,
    }
}

fn banded(weight: u32, band: u8) -> FlowClass {
    FlowClass {
        band,
        ..class(weight)
    }
}

fn reserved(weight: u32, reserved_slots: u32) -> FlowClass {
    FlowClass {
        reserved_slots,
        ..class(weight)
    }
}

/// A tiny deterministic generator (Knuth's MMIX LCG), so randomized tests replay exactly.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[track_caller]
fn granted<T: fmt::Debug>(submit: Submit<T>) -> FlowKey {
    match submit {
        Submit::Granted(flow) => flow,
        other => panic!("expected Granted, got {other:?}"),
    }
}

#[track_caller]
fn queued<T: fmt::Debug>(submit: Submit<T>) -> EntryKey {
    match submit {
        Submit::Queued(entry) => entry,
        other => panic!("expected Queued, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch orders, one slot, everything queued up front.

/// `n` requests of `tenant`, in a row.
fn burst(tenant: &'static str, class: FlowClass, cost: u64, n: usize) -> Vec<Arrival> {
    vec![(tenant, class, cost); n]
}

/// Alternating requests of two tenants, `n` each, `a` first.
fn interleaved(
    a: (&'static str, FlowClass),
    b: (&'static str, FlowClass),
    n: usize,
) -> Vec<Arrival> {
    (0..n)
        .flat_map(|_| [(a.0, a.1, 1), (b.0, b.1, 1)])
        .collect()
}

type Arrival = (&'static str, FlowClass, u64);

/// Queues `arrivals` behind one busy slot, then serves them one at a time and renders the
/// order in which the tenants got the slot.
#[track_caller]
fn check_order(arrivals: &[Arrival], expected: &str) {
    let mut q = FairQueue::new(1);
    let mut held = granted(q.submit("busy", class(1), 1, "busy"));
    for &(tenant, class, cost) in arrivals {
        queued(q.submit(tenant, class, cost, tenant));
    }
    let mut order = Vec::new();
    loop {
        q.release(held);
        let Some((flow, tenant)) = q.dispatch_next() else {
            break;
        };
        order.push(tenant);
        held = flow;
    }
    assert_eq!(order.join(" "), expected);
    assert_eq!((q.queued(), q.in_flight(), q.flow_count()), (0, 0, 0));
}

#[test]
fn dispatch_orders() {
    let cat = |parts: &[Vec<Arrival>]| parts.concat();
    // Equal weights alternate, whatever the arrival order.
    check_order(
        &cat(&[burst("a", class(1), 1, 3), burst("b", class(1), 1, 3)]),
        "a b a b a b",
    );
    check_order(
        &interleaved(("a", class(1)), ("b", class(1)), 3),
        "a b a b a b",
    );
    // 2:1, a's requests arrived first (ties go to the earliest arrival).
    check_order(
        &cat(&[burst("a", class(2), 1, 6), burst("b", class(1), 1, 3)]),
        "a b a a b a a b a",
    );
    // 2:1, b's requests arrived first: same shares, b wins the ties.
    check_order(
        &cat(&[burst("b", class(1), 1, 3), burst("a", class(2), 1, 6)]),
        "b a a b a a b a a",
    );
    // 3:1 with one tenant running dry: the other gets everything that is left.
    check_order(
        &cat(&[burst("a", class(3), 1, 4), burst("b", class(1), 1, 4)]),
        "a b a a a b b b",
    );
    // Three flows 4:2:1.
    check_order(
        &cat(&[
            burst("a", class(4), 1, 8),
            burst("b", class(2), 1, 4),
            burst("c", class(1), 1, 2),
        ]),
        "a b c a a b a a b c a a b a",
    );
    // Token cost: a's requests cost 3, b's cost 1, equal weights: b gets three requests per a.
    check_order(
        &cat(&[burst("a", class(1), 3, 3), burst("b", class(1), 1, 6)]),
        "a b b b a b b b a",
    );
    // Cost 0 counts as 1; weight 0 counts as 1.
    check_order(
        &cat(&[burst("a", class(1), 0, 3), burst("b", class(0), 1, 3)]),
        "a b a b a b",
    );
    // Strict bands: band 0 first, whatever the weights and arrival order; then band 1 fairly.
    check_order(
        &cat(&[
            burst("lo", banded(100, 1), 1, 2),
            burst("hi", banded(1, 0), 1, 3),
            burst("lo2", banded(1, 1), 1, 2),
        ]),
        "hi hi hi lo lo2 lo lo2",
    );
    // A reservation goes before the band order (and before a heavier weight).
    check_order(
        &cat(&[
            burst("hi", banded(1000, 0), 1, 2),
            burst(
                "r",
                FlowClass {
                    reserved_slots: 1,
                    ..banded(1, 2)
                },
                1,
                2,
            ),
        ]),
        "r r hi hi",
    );
}

// ---------------------------------------------------------------------------------------------
// Scripted orders: arrivals between dispatches.

/// Runs a script on a one-slot scheduler and renders who got the slot, in order.
/// Tokens: `a` submits one request of tenant `a` (cost 1), `a:7` one of cost 7, `a*3` three of
/// cost 1, `.` frees the slot and dispatches the next request, `.*4` does that four times.
/// Classes come from `classes` (weight 1, band 0 when not listed). A request granted at once
/// shows up in the order like a dispatch.
#[track_caller]
fn check_script(classes: &[(&str, FlowClass)], script: &str, expected: &str) {
    let class_of = |tenant: &str| {
        classes
            .iter()
            .find(|(name, _)| *name == tenant)
            .map_or(class(1), |&(_, class)| class)
    };
    let mut q: FairQueue<String> = FairQueue::new(1);
    let mut held = None;
    let mut order = Vec::new();
    for token in script.split_whitespace() {
        let (op, times) = match token.split_once('*') {
            Some((op, times)) => (op, times.parse().expect("count after *")),
            None => (token, 1),
        };
        for _ in 0..times {
            if op == "." {
                if let Some(flow) = held.take() {
                    q.release(flow);
                }
                if let Some((flow, tenant)) = q.dispatch_next() {
                    order.push(tenant);
                    held = Some(flow);
                }
                continue;
            }
            let (tenant, cost) = match op.split_once(':') {
                Some((tenant, cost)) => (tenant, cost.parse().expect("cost after :")),
                None => (op, 1),
            };
            match q.submit(tenant, class_of(tenant), cost, tenant.to_string()) {
                Submit::Granted(flow) => {
                    order.push(tenant.to_string());
                    held = Some(flow);
                }
                Submit::Queued(_) => {}
                Submit::Full(_) => order.push(format!("full:{tenant}")),
            }
        }
    }
    assert_eq!(order.join(" "), expected);
}

#[test]
fn scripted_orders() {
    // Work conservation: the first request runs at once, the rest follow in order.
    check_script(&[], "a*3 .*3", "a a a");
    // A late arrival starts at the present: it alternates with a, it does not catch up on the
    // dispatches a had while b was away.
    check_script(&[], "a*10 .*5 b*3 .*8", "a a a a a a b a b a b a a");
    // Same with b heavier: b gets its 3:1 from its arrival on, no more.
    check_script(
        &[("b", class(3))],
        "a*10 .*4 b*6 .*10",
        "a a a a a b b b a b b b a a a",
    );
    // A tenant that comes and goes keeps no credit: after its queue ran dry it restarts at
    // the present. (b is served twice in a row around its own dispatch; never more.)
    check_script(&[], "a*6 b .*2 b .*6", "a b a b a a a a");
    // Queue limits: queue_max 1 lets one wait, refuses the next ones.
    check_script(
        &[(
            "a",
            FlowClass {
                queue_max: 1,
                ..class(1)
            },
        )],
        "b a a a .",
        "b full:a full:a a",
    );
    // queue_max 0 never queues, but runs at once when the budget is free.
    check_script(
        &[(
            "a",
            FlowClass {
                queue_max: 0,
                ..class(1)
            },
        )],
        "a . b a .",
        "a b full:a",
    );
    // Token cost with arrivals in between: b (cost 1) gets ten requests per a (cost 10).
    check_script(&[], "a:10*2 b*12 .*14", "a b b b b b b b b b b a b b");
}

// ---------------------------------------------------------------------------------------------
// Long runs: shares.

#[derive(Clone, Copy)]
enum Size {
    Fixed(u64),
    /// Uniform in lo..=hi.
    Uniform(u64, u64),
}

impl Size {
    fn draw(self, rng: &mut Lcg) -> u64 {
        match self {
            Size::Fixed(n) => n,
            Size::Uniform(lo, hi) => lo + rng.below(hi - lo + 1),
        }
    }
}

/// What one tenant got in a backlogged run.
#[derive(Debug, Default, Clone, Copy)]
struct Got {
    requests: u64,
    tokens: u64,
}

/// Every tenant keeps `depth` requests queued; `limit` slots complete oldest first; the run
/// counts `dispatches` dispatches. `token_cost` charges each request its size, else 1.
fn backlogged_run(
    tenants: &[(FlowClass, Size)],
    limit: u32,
    dispatches: usize,
    token_cost: bool,
) -> Vec<Got> {
    let mut rng = Lcg(7);
    let mut q: FairQueue<(usize, u64)> = FairQueue::new(limit);
    let names: Vec<String> = (0..tenants.len()).map(|i| format!("t{i}")).collect();
    // Fill the budget with a warm-up tenant so that every request below has to queue.
    let mut held: VecDeque<FlowKey> = (0..limit)
        .map(|_| granted(q.submit("warm", class(1), 1, (usize::MAX, 0))))
        .collect();
    let submit = |q: &mut FairQueue<(usize, u64)>, rng: &mut Lcg, tenant: usize| {
        let (class, size) = tenants[tenant];
        let tokens = size.draw(rng);
        let cost = if token_cost { tokens } else { 1 };
        queued(q.submit(&names[tenant], class, cost, (tenant, tokens)));
    };
    for _ in 0..4 {
        for tenant in 0..tenants.len() {
            submit(&mut q, &mut rng, tenant);
        }
    }
    let mut got = vec![Got::default(); tenants.len()];
    for _ in 0..dispatches {
        q.release(held.pop_front().expect("the budget is full"));
        let (flow, (tenant, tokens)) = q.dispatch_next().expect("everyone is backlogged");
        held.push_back(flow);
        got[tenant].requests += 1;
        got[tenant].tokens += tokens;
        submit(&mut q, &mut rng, tenant);
    }
    got
}

#[track_caller]
fn assert_shares(what: &str, got: &[u64], weights: &[u64]) {
    let total: u64 = got.iter().sum();
    let weight_total: u64 = weights.iter().sum();
    for (i, (&got, &weight)) in got.iter().zip(weights).enumerate() {
        let share = got as f64 / total as f64;
        let expected = weight as f64 / weight_total as f64;
        assert!(
            (share - expected).abs() <= 0.02 * expected,
            "{what}: tenant {i} got {share:.4} of the total, expected {expected:.4} (±2%): {got:?}"
        );
    }
}

#[test]
fn request_shares_follow_weights() {
    let tenants = [
        (class(4), Size::Uniform(10, 2000)),
        (class(2), Size::Uniform(10, 2000)),
        (class(1), Size::Uniform(10, 2000)),
    ];
    for limit in [1, 16] {
        let got = backlogged_run(&tenants, limit, 70_000, false);
        let requests: Vec<u64> = got.iter().map(|g| g.requests).collect();
        assert_shares("requests", &requests, &[4, 2, 1]);
    }
}

#[test]
fn token_cost_shares_tokens_not_requests() {
    // Equal weights, very different request sizes: equal tokens.
    let tenants = [
        (class(1), Size::Fixed(100)),
        (class(1), Size::Fixed(400)),
        (class(1), Size::Uniform(10, 1000)),
    ];
    let got = backlogged_run(&tenants, 8, 70_000, true);
    let tokens: Vec<u64> = got.iter().map(|g| g.tokens).collect();
    assert_shares("tokens", &tokens, &[1, 1, 1]);
    // ... so the tenant with small requests gets four times the requests of the 400-token one.
    let requests: Vec<u64> = got.iter().take(2).map(|g| g.requests).collect();
    assert_shares("requests", &requests, &[4, 1]);

    // Weighted 4:2:1 in tokens, sizes drawn at random.
    let tenants = [
        (class(4), Size::Uniform(1, 4000)),
        (class(2), Size::Uniform(1, 500)),
        (class(1), Size::Uniform(100, 8000)),
    ];
    let got = backlogged_run(&tenants, 8, 70_000, true);
    let tokens: Vec<u64> = got.iter().map(|g| g.tokens).collect();
    assert_shares("tokens", &tokens, &[4, 2, 1]);
}

#[test]
fn request_cost_shares_requests_whatever_the_sizes() {
    let tenants = [(class(1), Size::Fixed(100)), (class(1), Size::Fixed(400))];
    let got = backlogged_run(&tenants, 8, 70_000, false);
    let requests: Vec<u64> = got.iter().map(|g| g.requests).collect();
    assert_shares("requests", &requests, &[1, 1]);
}

#[test]
fn no_starvation_against_a_much_heavier_flow() {
    let tenants = [(class(1000), Size::Fixed(1)), (class(1), Size::Fixed(1))];
    let mut q: FairQueue<usize> = FairQueue::new(1);
    let mut held = granted(q.submit("warm", class(1), 1, usize::MAX));
    for (i, (class, _)) in tenants.iter().enumerate() {
        for _ in 0..2 {
            queued(q.submit(&format!("t{i}"), *class, 1, i));
        }
    }
    let mut since_light = 0;
    let mut longest_wait = 0;
    let mut light = 0;
    for _ in 0..100_000 {
        q.release(held);
        let (flow, tenant) = q.dispatch_next().expect("backlogged");
        held = flow;
        queued(q.submit(&format!("t{tenant}"), tenants[tenant].0, 1, tenant));
        if tenant == 1 {
            light += 1;
            longest_wait = longest_wait.max(since_light);
            since_light = 0;
        } else {
            since_light += 1;
        }
    }
    // SFQ's bound: the light flow waits at most one full turn of the heavy flow.
    assert!(
        longest_wait <= 1000,
        "light flow waited {longest_wait} dispatches"
    );
    assert!(
        (99..=100).contains(&light),
        "light flow got {light} of 100,000"
    );
}

// ---------------------------------------------------------------------------------------------
// Work conservation and idle credit.

#[test]
fn a_lone_tenant_gets_the_whole_budget() {
    let mut q = FairQueue::new(8);
    let slots: Vec<FlowKey> = (0..8)
        .map(|i| granted(q.submit("a", class(1), 1, i)))
        .collect();
    assert!(
        slots.iter().all(|&flow| flow == slots[0]),
        "one flow, one key"
    );
    assert_eq!(q.in_flight(), 8);
    let waiting = queued(q.submit("a", class(1), 1, 8));
    assert_eq!(q.dispatch_next(), None, "the budget is full");
    q.release(slots[0]);
    assert_eq!(q.dispatch_next(), Some((slots[0], 8)));
    assert_eq!(q.cancel(waiting), None, "dispatched: the key is stale");
    assert_eq!((q.in_flight(), q.queued(), q.flow_count()), (8, 0, 1));
}

/// Serves `n` dispatches from a one-slot queue whose tenants stay backlogged, returning who got
/// each.
fn serve_backlogged(
    q: &mut FairQueue<&'static str>,
    held: &mut FlowKey,
    classes: &[(&'static str, FlowClass)],
    n: usize,
) -> Vec<&'static str> {
    (0..n)
        .map(|_| {
            q.release(*held);
            let (flow, tenant) = q.dispatch_next().expect("backlogged");
            *held = flow;
            let class = classes
                .iter()
                .find(|(name, _)| *name == tenant)
                .map(|c| c.1);
            queued(q.submit(tenant, class.expect("known tenant"), 1, tenant));
            tenant
        })
        .collect()
}

#[test]
fn idle_credit_does_not_accumulate() {
    for b_keeps_a_slot in [false, true] {
        let classes = [("a", class(1)), ("b", class(1))];
        let mut q = FairQueue::new(2);
        let mut held = granted(q.submit("a", class(1), 1, "a"));
        // b holds the other slot through a's long run when asked to, so its flow record (and
        // its old finish tag) survives; otherwise b is forgotten.
        let b_slot = granted(q.submit("b", class(1), 1, "b"));
        if !b_keeps_a_slot {
            q.release(b_slot);
            q.set_limit(1);
        } else {
            assert_eq!(q.flow_count(), 2);
        }
        queued(q.submit("a", class(1), 1, "a"));
        let alone = serve_backlogged(&mut q, &mut held, &classes, 10_000);
        assert!(alone.iter().all(|&t| t == "a"));

        // b turns up backlogged: from now on it gets its half, not a burst of 10,000.
        queued(q.submit("b", class(1), 1, "b"));
        let after = serve_backlogged(&mut q, &mut held, &classes, 1_000);
        let first: Vec<&str> = after.iter().take(8).copied().collect();
        // b starts at the present (the start tag of a's last dispatch), a's next request one
        // step later: b goes first, then they alternate.
        assert_eq!(
            first.join(" "),
            "b a b a b a b a",
            "b keeps a slot: {b_keeps_a_slot}"
        );
        let b_count = after.iter().filter(|&&t| t == "b").count();
        assert!((499..=501).contains(&b_count), "b got {b_count} of 1000");
    }
}

// ---------------------------------------------------------------------------------------------
// Bands and reservations.

#[test]
fn strict_bands_serve_band_0_while_it_has_backlog() {
    let mut q = FairQueue::new(1);
    let mut held = granted(q.submit("warm", class(1), 1, "warm"));
    for _ in 0..50 {
        queued(q.submit("free", banded(10, 1), 1, "free"));
        queued(q.submit("paid", banded(1, 0), 1, "paid"));
    }
    queued(q.submit("free2", banded(10, 1), 1, "free2"));
    assert_eq!(
        (
            q.queued_in_band(0),
            q.queued_in_band(1),
            q.queued_in_band(2)
        ),
        (50, 51, 0)
    );
    let mut order = Vec::new();
    loop {
        q.release(held);
        let Some((flow, tenant)) = q.dispatch_next() else {
            break;
        };
        held = flow;
        order.push(tenant);
        // band 0 keeps a backlog for the first 100 dispatches
        if order.len() <= 50 {
            queued(q.submit("paid", banded(1, 0), 1, "paid"));
        }
    }
    assert!(order[..100].iter().all(|&t| t == "paid"));
    assert_eq!(order[100..104].join(" "), "free free2 free free");
    assert_eq!(q.queued_in_band(0) + q.queued_in_band(1), 0);
}

/// Limit 10; `f` floods, `r` keeps 5 requests queued; slots complete oldest first. Returns
/// r's in-flight count after each completion once warmed up, and r's share of dispatches.
fn reservation_run(r_class: FlowClass, f_class: FlowClass) -> (Vec<u32>, f64) {
    let mut q: FairQueue<&'static str> = FairQueue::new(10);
    let mut held: VecDeque<(FlowKey, &'static str)> = VecDeque::new();
    // f got there first and holds the whole budget.
    for _ in 0..10 {
        held.push_back((granted(q.submit("f", f_class, 1, "f")), "f"));
    }
    for _ in 0..50 {
        queued(q.submit("f", f_class, 1, "f"));
    }
    for _ in 0..5 {
        queued(q.submit("r", r_class, 1, "r"));
    }
    let mut r_in_flight = Vec::new();
    let mut r_dispatches = 0;
    let rounds = 20_000;
    for round in 0..rounds {
        let (flow, _) = held.pop_front().expect("budget is full");
        q.release(flow);
        while let Some((flow, tenant)) = q.dispatch_next() {
            held.push_back((flow, tenant));
            let class = if tenant == "r" { r_class } else { f_class };
            queued(q.submit(tenant, class, 1, tenant));
            if tenant == "r" {
                r_dispatches += 1;
            }
        }
        // Warm-up: r waits for f's slots to come free one by one.
        if round >= 10 {
            r_in_flight.push(held.iter().filter(|(_, t)| *t == "r").count() as u32);
        }
    }
    (r_in_flight, r_dispatches as f64 / rounds as f64)
}

#[test]
fn reservation_holds_under_a_flood() {
    // r reserved 20% of 10 = 2 slots, weight 1 against f's 1000.
    let (r_in_flight, share) = reservation_run(reserved(1, 2), class(1000));
    assert!(
        r_in_flight.iter().all(|&n| n >= 2),
        "r fell below its reservation"
    );
    assert!(
        share < 0.21,
        "r holds about its reservation, got {share:.3}"
    );

    // The reservation is what did it: without one, weight 1 of 1001 gets next to nothing.
    let (r_in_flight, share) = reservation_run(class(1), class(1000));
    assert!(r_in_flight.iter().filter(|&&n| n >= 2).count() < r_in_flight.len() / 100);
    assert!(share < 0.01, "got {share:.3}");
}

#[test]
fn reservation_is_a_floor_not_an_addition() {
    // r's weighted share (half of 10) is above its reservation: the reservation never binds,
    // and r gets its half, not 2 + half of the rest.
    let (r_in_flight, share) = reservation_run(reserved(1, 2), class(1));
    assert!(r_in_flight.iter().all(|&n| n >= 2));
    assert!((0.49..=0.51).contains(&share), "r got {share:.3}");

    // Reservation 4 above the weighted share (1/4 of 10): r holds its 4 and a little of the
    // rest, far from 4 + a quarter of the other 6.
    let (r_in_flight, share) = reservation_run(reserved(1, 4), class(3));
    assert!(r_in_flight.iter().all(|&n| n >= 4));
    assert!((0.40..=0.48).contains(&share), "r got {share:.3}");
}

#[test]
fn reservation_beats_bands_and_waits_for_a_free_slot() {
    let mut q = FairQueue::new(2);
    let hi = granted(q.submit("hi", banded(1, 0), 1, "hi"));
    granted(q.submit("hi", banded(1, 0), 1, "hi"));
    queued(q.submit("hi", banded(1, 0), 1, "hi"));
    let r_class = FlowClass {
        reserved_slots: 1,
        ..banded(1, 3)
    };
    queued(q.submit("r", r_class, 1, "r"));
    queued(q.submit("r", r_class, 1, "r"));
    // No preemption: the budget is full.
    assert_eq!(q.dispatch_next(), None);
    q.release(hi);
    let (r_flow, tenant) = q.dispatch_next().expect("a slot is free");
    assert_eq!(tenant, "r");
    // r now holds its reserved slot; its second request waits in band 3 behind band 0.
    q.release(hi);
    assert_eq!(q.dispatch_next().map(|d| d.1), Some("hi"));
    q.release(r_flow);
    assert_eq!(q.dispatch_next().map(|d| d.1), Some("r"));
}

// ---------------------------------------------------------------------------------------------
// Queue limits, cancellation, limits, flow lifetime.

#[test]
fn full_hands_the_payload_back_and_takes_nothing() {
    let mut q = FairQueue::new(1);
    let small = FlowClass {
        queue_max: 2,
        ..class(1)
    };
    granted(q.submit("a", small, 1, 0));
    queued(q.submit("a", small, 1, 1));
    queued(q.submit("a", small, 1, 2));
    assert!(matches!(q.submit("a", small, 1, 3), Submit::Full(3)));
    // Another tenant has its own queue.
    queued(q.submit("b", small, 1, 4));
    assert_eq!((q.queued(), q.in_flight()), (3, 1));

    // queue_max 0 never queues; a refused tenant leaves no flow behind.
    let never = FlowClass {
        queue_max: 0,
        ..class(1)
    };
    assert!(matches!(q.submit("c", never, 1, 5), Submit::Full(5)));
    assert_eq!(q.flow_count(), 2);

    // The newest class applies: a smaller queue_max refuses new requests, evicts nothing.
    let tiny = FlowClass {
        queue_max: 1,
        ..class(1)
    };
    assert!(matches!(q.submit("a", tiny, 1, 6), Submit::Full(6)));
    assert_eq!(q.queued(), 3);
}

#[test]
fn cancel_from_the_middle_head_and_tail() {
    let mut q = FairQueue::new(1);
    let held = granted(q.submit("busy", class(1), 1, "busy"));
    let a: Vec<EntryKey> = ["a0", "a1", "a2", "a3", "a4"]
        .into_iter()
        .map(|p| queued(q.submit("a", class(1), 1, p)))
        .collect();
    let b0 = queued(q.submit("b", class(1), 1, "b0"));
    assert_eq!(q.cancel(a[2]), Some("a2"), "middle");
    assert_eq!(q.cancel(a[0]), Some("a0"), "head");
    assert_eq!(q.cancel(a[4]), Some("a4"), "tail");
    assert_eq!(q.cancel(a[2]), None, "stale: already cancelled");
    assert_eq!(q.queued(), 3);
    // The cancelled head did not cost a its place: a (arrived first) still goes first.
    q.release(held);
    let (held, first) = q.dispatch_next().expect("slot free");
    assert_eq!(first, "a1");
    assert_eq!(q.cancel(a[1]), None, "stale: dispatched");
    assert_eq!(q.cancel(b0), Some("b0"));
    q.release(held);
    assert_eq!(q.dispatch_next().map(|d| d.1), Some("a3"));
    assert_eq!(q.dispatch_next(), None);
}

#[test]
fn cancel_frees_the_queue_place() {
    let mut q = FairQueue::new(1);
    let one = FlowClass {
        queue_max: 1,
        ..class(1)
    };
    granted(q.submit("busy", class(1), 1, 0));
    let first = queued(q.submit("a", one, 1, 1));
    assert!(matches!(q.submit("a", one, 1, 2), Submit::Full(2)));
    assert_eq!(q.cancel(first), Some(1));
    assert_eq!(q.flow_count(), 1, "a had nothing left: forgotten");
    let second = queued(q.submit("a", one, 1, 3));
    assert_ne!(second, first, "a reused slot gets a new generation");
    assert_eq!(q.cancel(first), None);
    assert_eq!(q.queued(), 1);
}

#[test]
fn release_then_dispatch_next() {
    let mut q = FairQueue::new(2);
    let a = granted(q.submit("a", class(1), 1, "a"));
    let b = granted(q.submit("b", class(1), 1, "b"));
    queued(q.submit("c", class(1), 1, "c"));
    q.release(a);
    assert_eq!(q.in_flight(), 1, "release does not dispatch");
    assert_eq!(q.queued(), 1);
    let (c, tenant) = q.dispatch_next().expect("a slot is free");
    assert_eq!(tenant, "c");
    assert_eq!(q.dispatch_next(), None);
    assert_eq!(q.released(), 1);
    q.release(a);
    assert_eq!(q.in_flight(), 2, "a's flow is gone: its key is stale");
    assert_eq!(
        q.released(),
        1,
        "a stale key releases nothing, and counts as nothing"
    );
    q.release(b);
    q.release(c);
    assert_eq!((q.in_flight(), q.flow_count()), (0, 0));
    q.release(c);
    assert_eq!(q.released(), 3, "each grant released once");
    // Nothing queued and a slot free: granted at once again.
    granted(q.submit("a", class(1), 1, "a"));
}

#[test]
fn set_limit_up_dispatches_more_and_down_never_preempts() {
    let mut q = FairQueue::new(2);
    let a = granted(q.submit("a", class(1), 1, 0));
    granted(q.submit("a", class(1), 1, 1));
    for i in 2..8 {
        queued(q.submit("a", class(1), 1, i));
    }
    q.set_limit(5);
    let more: Vec<u32> = std::iter::from_fn(|| q.dispatch_next().map(|d| d.1)).collect();
    assert_eq!(more, [2, 3, 4]);
    assert_eq!(q.in_flight(), 5);

    q.set_limit(2);
    assert_eq!((q.limit(), q.in_flight()), (2, 5), "nothing preempted");
    for expected_in_flight in [4, 3, 2] {
        q.release(a);
        assert_eq!(q.dispatch_next(), None, "draining towards the new limit");
        assert_eq!(q.in_flight(), expected_in_flight);
    }
    q.release(a);
    assert_eq!(q.dispatch_next(), Some((a, 5)));

    q.set_limit(0);
    assert_eq!(
        q.limit(),
        0,
        "a fleet member without a share admits nothing"
    );
    q.release(a);
    assert_eq!(q.dispatch_next(), None);
    assert!(matches!(q.submit("b", class(1), 1, 6), Submit::Queued(_)));
}

#[test]
fn flows_are_removed_when_idle() {
    let mut q = FairQueue::new(1);
    assert_eq!(q.flow_count(), 0);
    let a = granted(q.submit("a", class(1), 1, 0));
    let b = queued(q.submit("b", class(1), 1, 1));
    queued(q.submit("c", class(1), 1, 2));
    assert_eq!(q.flow_count(), 3);
    q.cancel(b);
    assert_eq!(q.flow_count(), 2, "b: nothing queued, nothing in flight");
    q.release(a);
    assert_eq!(q.flow_count(), 1, "a: released its only slot");
    let (c, _) = q.dispatch_next().expect("slot free");
    assert_eq!(q.flow_count(), 1, "c: one slot in flight");
    q.release(c);
    assert_eq!(q.flow_count(), 0);
    check_structure(&q);
}

#[test]
fn newest_class_applies_to_the_whole_flow() {
    let mut q = FairQueue::new(1);
    let mut held = granted(q.submit("busy", class(1), 1, "busy"));
    for _ in 0..3 {
        queued(q.submit("a", banded(1, 1), 1, "a"));
        queued(q.submit("b", banded(1, 0), 1, "b"));
    }
    assert_eq!((q.queued_in_band(0), q.queued_in_band(1)), (3, 3));
    // a moves to band 0, with all its queued requests.
    queued(q.submit("a", banded(1, 0), 1, "a"));
    assert_eq!((q.queued_in_band(0), q.queued_in_band(1)), (7, 0));
    check_structure(&q);
    let mut order = Vec::new();
    while {
        q.release(held);
        q.dispatch_next().map(|(flow, tenant)| {
            held = flow;
            order.push(tenant);
        })
    }
    .is_some()
    {}
    // a restarts at band 0's present, like b; a's head arrived first.
    assert_eq!(order.join(" "), "a b a b a b a");
}

// ---------------------------------------------------------------------------------------------
// Randomized operation sequences against a model.

/// Checks the internal structure: lists, keys, counts and the name index agree.
fn check_structure<T>(q: &FairQueue<T>) {
    let mut live = 0;
    let mut queued = 0;
    let mut in_flight = 0;
    let mut keyed = 0;
    let mut by_band = [0u32; BANDS];
    for (index, slot) in q.flows.iter().enumerate() {
        let Some(flow) = &slot.flow else {
            continue;
        };
        let index = index as u32;
        live += 1;
        assert_eq!(q.by_name.get(&flow.name), Some(&index));
        assert!(flow.queued > 0 || flow.in_flight > 0, "idle flow kept");
        let mut length = 0;
        let mut prev = NIL;
        let mut at = flow.head;
        while at != NIL {
            let entry = q.entry(at);
            assert_eq!((entry.flow, entry.prev), (index, prev));
            length += 1;
            prev = at;
            at = entry.next;
        }
        assert_eq!((length, prev), (flow.queued, flow.tail));
        queued += flow.queued;
        in_flight += flow.in_flight;
        by_band[usize::from(flow.class.band)] += flow.queued;
        if flow.queued > 0 {
            keyed += 1;
            let key = flow.order.expect("a backlogged flow has a key");
            assert!(q.order.contains(&key));
            let expected = OrderKey {
                lane: flow.lane(),
                band: flow.class.band,
                start: flow.head_start,
                seq: q.entry(flow.head).seq,
                flow: index,
            };
            assert_eq!(key, expected);
        } else {
            assert_eq!(flow.order, None);
        }
    }
    assert_eq!(q.by_name.len(), live);
    assert_eq!(q.order.len(), keyed);
    // The standby order holds exactly the backlogged flows with the right, under their keys.
    let standby_keys: BTreeSet<OrderKey> = q
        .flows
        .iter()
        .filter_map(|slot| slot.flow.as_ref())
        .filter(|f| q.standby > 0 && f.has_standby_right())
        .filter_map(|f| f.order)
        .collect();
    assert_eq!(q.standby_order, standby_keys);
    for flow in q.flows.iter().filter_map(|slot| slot.flow.as_ref()) {
        let expected = flow
            .order
            .filter(|_| q.standby > 0 && flow.has_standby_right());
        assert_eq!(flow.standby_key, expected);
    }
    let usage_keyed = if q.headroom.is_some() { keyed } else { 0 };
    assert_eq!(q.by_usage.len(), usage_keyed);
    let live_flows = || q.flows.iter().filter_map(|slot| slot.flow.as_ref());
    assert_eq!(
        q.live_weight,
        live_flows()
            .map(|f| u64::from(f.counted_weight))
            .sum::<u64>()
    );
    assert_eq!(q.lent, live_flows().map(|f| f.lent).sum::<u32>());
    for band in 0..BANDS {
        let protected: u32 = live_flows()
            .filter(|f| f.protected && usize::from(f.class.band) == band)
            .map(|f| f.in_flight)
            .sum();
        assert_eq!(q.protected[band].in_flight, protected, "band {band}");
        let queued: u32 = live_flows()
            .filter(|f| f.protected && usize::from(f.class.band) == band)
            .map(|f| f.queued)
            .sum();
        assert_eq!(q.protected[band].queued, queued, "band {band}");
    }
    assert_eq!((q.queued, q.in_flight), (queued, in_flight));
    assert_eq!(*q.queued_by_band, by_band);
    let occupied = q
        .entries
        .iter()
        .filter(|slot| matches!(slot.slot, Slot::Occupied(_)))
        .count();
    assert_eq!(occupied, q.queued as usize);
    let mut free = 0;
    let mut at = q.free_entry;
    while at != NIL {
        let Slot::Vacant { next_free } = q.entries[at as usize].slot else {
            panic!("free list reaches an occupied slot");
        };
        free += 1;
        at = next_free;
    }
    assert_eq!(free + occupied, q.entries.len());
}

/// A payload that notes when it is dropped, so the test sees any payload the queue loses.
struct Tracked {
    id: u64,
    dropped: Rc<RefCell<Vec<u64>>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.dropped.borrow_mut().push(self.id);
    }
}

impl fmt::Debug for Tracked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tracked({})", self.id)
    }
}

const TENANTS: [&str; 6] = ["t0", "t1", "t2", "t3", "t4", "t5"];

/// The expected state, kept the slow and obvious way: per-tenant queues scanned on every
/// dispatch, tags recomputed from the rules in the module documentation.
struct Model {
    class: [FlowClass; TENANTS.len()],
    /// (payload id, key, cost); ids grow with arrival, so they double as arrival order.
    queue: [VecDeque<(u64, EntryKey, u64)>; TENANTS.len()],
    in_flight: [u32; TENANTS.len()],
    finish: [u128; TENANTS.len()],
    head_start: [u128; TENANTS.len()],
    virtual_time: [u128; 3],
    key: [Option<FlowKey>; TENANTS.len()],
    held: Vec<(FlowKey, usize)>,
    /// Keys the queue must ignore: dispatched or cancelled entries, flows that went idle.
    stale_entries: Vec<EntryKey>,
    stale_flows: Vec<FlowKey>,
    /// Every payload handed back (dispatch, cancel, Full) or granted at once.
    accounted: BTreeSet<u64>,
    next_id: u64,
}

impl Model {
    fn tenant_of(&self, id: u64) -> usize {
        (0..TENANTS.len())
            .find(|&t| self.queue[t].iter().any(|&(queued, ..)| queued == id))
            .expect("a dispatched payload was queued")
    }

    fn live(&self, tenant: usize) -> bool {
        !self.queue[tenant].is_empty() || self.in_flight[tenant] > 0
    }

    /// The newest class applies to the flow; a new flow starts with no history, and a flow
    /// changing band restarts at that band's present.
    fn apply_class(&mut self, tenant: usize, class: FlowClass) {
        if !self.live(tenant) {
            self.finish[tenant] = 0;
        } else if self.class[tenant].band != class.band {
            self.finish[tenant] = 0;
            self.head_start[tenant] = self.virtual_time[usize::from(class.band)];
        }
        self.class[tenant] = class;
    }

    fn reserved_lane(&self, tenant: usize) -> bool {
        self.in_flight[tenant] < self.class[tenant].reserved_slots
    }

    /// Gives `tenant` a slot for a request with tag `start`, charging it outside reservations.
    fn take_slot(&mut self, tenant: usize, start: u128, cost: u64) {
        if !self.reserved_lane(tenant) {
            let band = usize::from(self.class[tenant].band);
            self.virtual_time[band] = self.virtual_time[band].max(start);
            self.finish[tenant] = start + charge(cost, self.class[tenant].weight);
        }
        self.in_flight[tenant] += 1;
    }

    fn tag_head(&mut self, tenant: usize) {
        let band = usize::from(self.class[tenant].band);
        self.head_start[tenant] = self.virtual_time[band].max(self.finish[tenant]);
    }

    /// The tenant whose head should go next: reservations, then band, then start tag, then
    /// arrival.
    fn expected_next(&self) -> Option<usize> {
        (0..TENANTS.len())
            .filter(|&t| !self.queue[t].is_empty())
            .min_by_key(|&t| {
                (
                    !self.reserved_lane(t),
                    self.class[t].band,
                    self.head_start[t],
                    self.queue[t][0].0,
                )
            })
    }

    fn total_queued(&self) -> u32 {
        self.queue.iter().map(|q| q.len() as u32).sum()
    }

    /// Forgets a tenant's flow key once it has nothing queued and nothing in flight.
    fn note_if_idle(&mut self, tenant: usize) {
        if !self.live(tenant)
            && let Some(key) = self.key[tenant].take()
        {
            self.stale_flows.push(key);
        }
    }

    fn set_key(&mut self, tenant: usize, key: FlowKey) {
        match self.key[tenant] {
            Some(known) => assert_eq!(known, key, "one key per live flow"),
            None => self.key[tenant] = Some(key),
        }
    }

    fn account(&mut self, id: u64) {
        assert!(self.accounted.insert(id), "payload {id} came back twice");
    }
}

fn random_class(rng: &mut Lcg) -> FlowClass {
    FlowClass {
        weight: 1 + rng.below(4) as u32,
        band: rng.below(3) as u8,
        queue_max: rng.below(6) as u32,
        reserved_slots: rng.below(3) as u32,
    }
}

fn random_run(seed: u64, steps: usize) {
    let mut rng = Lcg(seed);
    let dropped = Rc::new(RefCell::new(Vec::new()));
    let mut q: FairQueue<Tracked> = FairQueue::new(1 + rng.below(6) as u32);
    let mut m = Model {
        class: std::array::from_fn(|_| random_class(&mut rng)),
        queue: Default::default(),
        in_flight: [0; TENANTS.len()],
        finish: [0; TENANTS.len()],
        head_start: [0; TENANTS.len()],
        virtual_time: [0; 3],
        key: [None; TENANTS.len()],
        held: Vec::new(),
        stale_entries: Vec::new(),
        stale_flows: Vec::new(),
        accounted: BTreeSet::new(),
        next_id: 0,
    };

    let mut dropped_seen = 0;
    for step in 0..steps {
        let roll = rng.below(100);
        if roll < 40 {
            // submit
            let tenant = rng.below(TENANTS.len() as u64) as usize;
            let class = if rng.chance(10) {
                random_class(&mut rng)
            } else {
                m.class[tenant]
            };
            let cost = rng.below(50);
            m.apply_class(tenant, class);
            let id = m.next_id;
            m.next_id += 1;
            let grantable = q.in_flight() < q.limit() && m.total_queued() == 0;
            let payload = Tracked {
                id,
                dropped: dropped.clone(),
            };
            match q.submit(TENANTS[tenant], class, cost, payload) {
                Submit::Granted(flow) => {
                    assert!(grantable, "step {step}: granted while not grantable");
                    m.account(id);
                    m.set_key(tenant, flow);
                    let band = usize::from(class.band);
                    let start = m.virtual_time[band].max(m.finish[tenant]);
                    m.take_slot(tenant, start, cost);
                    m.held.push((flow, tenant));
                }
                Submit::Queued(entry) => {
                    assert!(!grantable, "step {step}: queued while a slot was free");
                    assert!((m.queue[tenant].len() as u32) < class.queue_max);
                    m.queue[tenant].push_back((id, entry, cost));
                    if m.queue[tenant].len() == 1 {
                        m.tag_head(tenant);
                    }
                }
                Submit::Full(payload) => {
                    assert!(!grantable, "step {step}: refused while a slot was free");
                    assert!(m.queue[tenant].len() as u32 >= class.queue_max);
                    assert_eq!(payload.id, id);
                    m.account(id);
                }
            }
        } else if roll < 65 {
            // dispatch
            let was_full = q.in_flight() >= q.limit();
            let reserved_waiting: Vec<usize> = (0..TENANTS.len())
                .filter(|&t| !m.queue[t].is_empty() && m.in_flight[t] < m.class[t].reserved_slots)
                .collect();
            let backlogged: Vec<usize> = (0..TENANTS.len())
                .filter(|&t| !m.queue[t].is_empty())
                .collect();
            let expected = m.expected_next();
            match q.dispatch_next() {
                None => assert!(was_full || backlogged.is_empty(), "step {step}: idle slot"),
                Some((flow, payload)) => {
                    assert!(!was_full, "step {step}: dispatched over the limit");
                    let tenant = m.tenant_of(payload.id);
                    assert_eq!(Some(tenant), expected, "step {step}: dispatch order");
                    let start = m.head_start[tenant];
                    let (head, entry, cost) = m.queue[tenant].pop_front().expect("backlogged");
                    assert_eq!(head, payload.id, "step {step}: FIFO within a flow");
                    // Reservations first, then the highest band.
                    let candidates = if reserved_waiting.is_empty() {
                        &backlogged
                    } else {
                        &reserved_waiting
                    };
                    assert!(candidates.contains(&tenant), "step {step}: lane order");
                    let best_band = candidates.iter().map(|&t| m.class[t].band).min();
                    assert_eq!(Some(m.class[tenant].band), best_band, "step {step}: bands");
                    m.account(payload.id);
                    m.stale_entries.push(entry);
                    m.set_key(tenant, flow);
                    m.take_slot(tenant, start, cost);
                    if !m.queue[tenant].is_empty() {
                        m.tag_head(tenant);
                    }
                    m.held.push((flow, tenant));
                }
            }
        } else if roll < 82 {
            // release, sometimes with a stale key
            if rng.chance(20) && !m.stale_flows.is_empty() {
                let stale = m.stale_flows[rng.below(m.stale_flows.len() as u64) as usize];
                let before = (q.in_flight(), q.queued(), q.flow_count());
                q.release(stale);
                assert_eq!(before, (q.in_flight(), q.queued(), q.flow_count()));
            } else if !m.held.is_empty() {
                let (flow, tenant) = m.held.swap_remove(rng.below(m.held.len() as u64) as usize);
                q.release(flow);
                m.in_flight[tenant] -= 1;
                m.note_if_idle(tenant);
            }
        } else if roll < 96 {
            // cancel, sometimes with a stale key
            if rng.chance(25) && !m.stale_entries.is_empty() {
                let stale = m.stale_entries[rng.below(m.stale_entries.len() as u64) as usize];
                assert!(q.cancel(stale).is_none(), "step {step}: stale cancel");
            } else {
                let tenant = rng.below(TENANTS.len() as u64) as usize;
                if !m.queue[tenant].is_empty() {
                    let at = rng.below(m.queue[tenant].len() as u64) as usize;
                    // A cancelled head's start tag passes to the next request: nothing to do.
                    let (id, entry, _) = m.queue[tenant].remove(at).expect("in range");
                    let payload = q.cancel(entry).expect("still queued");
                    assert_eq!(payload.id, id);
                    m.account(id);
                    m.stale_entries.push(entry);
                    m.note_if_idle(tenant);
                }
            }
        } else {
            q.set_limit(1 + rng.below(8) as u32);
        }

        // Invariants after every step.
        assert_eq!(q.queued(), m.total_queued(), "step {step}");
        assert_eq!(
            q.in_flight(),
            m.in_flight.iter().sum::<u32>(),
            "step {step}"
        );
        for band in 0..3u8 {
            let expected: u32 = (0..TENANTS.len())
                .filter(|&t| m.class[t].band == band)
                .map(|t| m.queue[t].len() as u32)
                .sum();
            assert_eq!(q.queued_in_band(band), expected, "step {step}: band {band}");
        }
        let active = (0..TENANTS.len())
            .filter(|&t| !m.queue[t].is_empty() || m.in_flight[t] > 0)
            .count();
        assert_eq!(q.flow_count(), active, "step {step}: idle flows are gone");
        // The queue drops only payloads it granted at once; everything else comes back.
        for &id in &dropped.borrow()[dropped_seen..] {
            assert!(
                m.accounted.contains(&id),
                "step {step}: payload {id} was lost"
            );
        }
        dropped_seen = dropped.borrow().len();
        check_structure(&q);
    }

    // Drain: release everything, dispatch the rest, cancel nothing; every payload comes back
    // exactly once.
    q.set_limit(u32::MAX);
    while let Some((flow, payload)) = q.dispatch_next() {
        m.account(payload.id);
        m.held.push((flow, m.tenant_of(payload.id)));
    }
    for (flow, _) in m.held.drain(..) {
        q.release(flow);
    }
    assert_eq!((q.queued(), q.in_flight(), q.flow_count()), (0, 0, 0));
    check_structure(&q);
    assert_eq!(
        m.accounted.len() as u64,
        m.next_id,
        "every payload accounted once"
    );
    drop(q);
    let dropped_all: BTreeSet<u64> = dropped.borrow().iter().copied().collect();
    assert_eq!(dropped_all.len(), dropped.borrow().len());
    assert_eq!(dropped_all.len() as u64, m.next_id);
}

#[test]
fn random_operation_sequences_keep_the_invariants() {
    for seed in 1..=50 {
        random_run(seed, 4_000);
    }
}

#[test]
fn the_fleets_shares_override_weights_and_reservations_of_present_and_future_flows() {
    // Both tiers weigh 1, but the fleet allotted "a" three times what it allotted "b" here.
    let mut q = FairQueue::new(1);
    let mut shares: HashMap<TenantKey, Share> = HashMap::new();
    for (tenant, weight) in [("a", 3 * SHARE_SCALE), ("b", SHARE_SCALE)] {
        shares.insert(
            TenantKey::of(tenant),
            Share {
                weight,
                reserved_slots: 0,
                standby: false,
            },
        );
    }
    q.set_shares(shares);
    let holder = granted(q.submit("a", class(1), 1, 0));
    for i in 0..16 {
        queued(q.submit("a", class(1), 1, 100 + i));
        queued(q.submit("b", class(1), 1, 200 + i));
    }
    let mut order = Vec::new();
    q.release(holder);
    for _ in 0..16 {
        let (flow, payload) = q.dispatch_next().expect("a slot is free");
        order.push(if payload >= 200 { 'b' } else { 'a' });
        q.release(flow);
    }
    let a = order.iter().filter(|&&c| c == 'a').count();
    // 12 of 16 at 3:1, give or take the first dispatch (b starts at the present, a one charge
    // behind it from the holder).
    assert!(
        (11..=13).contains(&a),
        "3:1 by the fleet's weights: {order:?}"
    );

    // A tenant the fleet has not seen yet weighs its tier's weight as if all its demand were
    // here (SHARE_SCALE for weight 1): not starved by the others' shares.
    queued(q.submit("c", class(1), 1, 300));
    let mut served_c = false;
    for _ in 0..3 {
        let (flow, payload) = q.dispatch_next().expect("a slot is free");
        served_c |= payload == 300;
        q.release(flow);
    }
    assert!(served_c, "c is served among the next few");

    // Back to the tiers' weights: 1:1.
    q.set_shares(HashMap::new());
    let mut order = Vec::new();
    for _ in 0..2 {
        let (flow, payload) = q.dispatch_next().expect("a slot is free");
        order.push(if payload >= 200 { 'b' } else { 'a' });
        q.release(flow);
    }
    assert_eq!(order.iter().filter(|&&c| c == 'a').count(), 1, "{order:?}");

    // A reservation from the fleet puts a flow in the reserved lane.
    let mut q = FairQueue::new(1);
    let holder = granted(q.submit("x", class(1), 1, 0));
    queued(q.submit("x", class(1), 1, 1));
    queued(q.submit("y", class(1), 1, 2));
    q.set_shares(
        [(
            TenantKey::of("y"),
            Share {
                weight: 1,
                reserved_slots: 1,
                standby: false,
            },
        )]
        .into(),
    );
    q.release(holder);
    assert_eq!(
        q.dispatch_next().map(|(_, p)| p),
        Some(2),
        "y's reservation first"
    );
    check_structure(&q);
    let flows = q.flows();
    assert_eq!(flows.len(), 2);
    let y = flows
        .iter()
        .find(|f| f.tenant == TenantKey::of("y"))
        .unwrap();
    assert_eq!(
        (y.in_flight, y.queued, y.class.reserved_slots),
        (1, 0, 0),
        "as submitted"
    );
}

#[test]
fn a_flow_reports_the_mean_cost_of_its_requests() {
    let mut q = FairQueue::new(1);
    let holder = granted(q.submit("a", class(1), 100, 0));
    queued(q.submit("a", class(1), 300, 1));
    queued(q.submit("b", class(1), 0, 2));
    let mut flows = q.flows();
    flows.sort_by_key(|f| f.tenant != TenantKey::of("a"));
    assert_eq!(flows[0].mean_cost, 200, "granted and queued alike");
    assert_eq!(flows[1].mean_cost, 1, "a cost of 0 counts as 1");
    q.release(holder);
}

// ---------------------------------------------------------------------------------------------
// Headroom: isolation without caps.

/// The headroom without pacing: what the tables below were written for (pacing has its own).
const HEADROOM: Headroom = Headroom {
    window: Duration::from_secs(10),
    sigmas: 3.0,
    pace: false,
};

/// A queue with headroom whose steady flows have held `in_flight` slots for six windows, so
/// their means have converged on it.
fn steady(limit: u32, flows: &[(&str, FlowClass, u32)]) -> (FairQueue<u32>, Instant) {
    let start = Instant::now();
    let mut q = FairQueue::with_headroom(limit, HEADROOM);
    q.advance(start);
    let mut keys = Vec::new();
    for &(tenant, class, in_flight) in flows {
        for _ in 0..in_flight {
            keys.push((tenant, class, granted(q.submit(tenant, class, 1, 0))));
        }
    }
    let now = start + HEADROOM.window * 6;
    q.advance(now);
    // One request finishes and one starts per flow: flows are classified at their events, and
    // these are the first since each flow's start, when it was still bursting.
    for &(tenant, class, _) in flows.iter().filter(|flow| flow.2 > 0) {
        let &(_, _, key) = keys.iter().find(|k| k.0 == tenant).expect("granted above");
        q.release(key);
        granted(q.submit(tenant, class, 1, 0));
    }
    (q, now)
}

/// Submits `n` requests of `tenant` and counts the ones granted at once.
fn grants(q: &mut FairQueue<u32>, tenant: &str, class: FlowClass, n: u32) -> u32 {
    (0..n)
        .filter(|_| matches!(q.submit(tenant, class, 1, 0), Submit::Granted(_)))
        .count() as u32
}

#[test]
fn a_burst_takes_its_fair_share_and_what_the_steady_flows_will_not_need() {
    struct Case {
        what: &'static str,
        limit: u32,
        steady: Vec<(&'static str, FlowClass, u32)>,
        burst: FlowClass,
        /// The burst's requests granted at once, of 200.
        granted: u32,
        /// Held for the steady flows afterwards, and slots lent beyond fair shares.
        held: u32,
        lent: u32,
    }
    let cases = [
        Case {
            // Seed 000: A (weight 2) and C (2) hold 18 and 9 of 64; B (1) bursts. B's fair share
            // is 64 / 5 = 12.8 slots. The steady flows' spread may still need
            // ceil(27 + 3 √27) - 27 = 16 more than they hold; but with 55 in flight, 27 / 55 =
            // 0.49 of each release's worth of their arrivals come per release, and 9 free
            // slots are found all taken with a chance of 0.13 % (the 3σ tail) at that rate. So
            // B may fill 64 - 27 - 9 = 28.
            what: "seed 000",
            limit: 64,
            steady: vec![("a", class(2), 18), ("c", class(2), 9)],
            burst: class(1),
            granted: 28,
            held: 9,
            lent: 28 - 12,
        },
        Case {
            // Seed 001's sweep near its knee: A (2) steady at 44 of 140, B (1) backlogged. A's
            // spread is ceil(44 + 3 √44) - 44 = 20, but a slot frees about every 1 / 134 of a
            // hold while A sends 44 per hold: 0.33 of A's requests come per release, and 6 free
            // slots are missed 0.13 % of the time at that rate. B fills all but those 6, where
            // its spread would have left 20 free.
            what: "many releases per arrival",
            limit: 140,
            steady: vec![("a", class(2), 44)],
            burst: class(1),
            granted: 90,
            held: 6,
            lent: 90 - 46,
        },
        Case {
            what: "alone: the whole budget",
            limit: 64,
            steady: vec![],
            burst: class(1),
            granted: 64,
            held: 0,
            lent: 0,
        },
        Case {
            // Within its fair share a flow is never held back: 2 / 3 of 30 is 20.
            what: "fair share first",
            limit: 30,
            steady: vec![("a", class(1), 10)],
            burst: class(2),
            granted: 20,
            held: 0,
            lent: 0,
        },
        Case {
            // A burst's fair share is its own, even beside a steady flow beyond its share: b
            // takes the 8 free slots, all within its 16.
            what: "steady beyond its share, burst within its own",
            limit: 32,
            steady: vec![("a", class(1), 24)],
            burst: class(1),
            granted: 8,
            held: 0,
            lent: 0,
        },
        Case {
            // Seed 000's heavy-steady variant: A holds 36 (its weight's share is 64 × 2 / 5 =
            // 25.6) and C 9, steadily. Both are protected: ceil(45 + 3 √45) = 66 is expected,
            // 21 more than they hold. B gets its own fair share (12 slots), nothing lent, and
            // the 7 left stay free for A and C (whose next requests, A's beyond its share
            // included, go at once).
            what: "heavy steady",
            limit: 64,
            steady: vec![("a", class(2), 36), ("c", class(2), 9)],
            burst: class(1),
            granted: 12,
            held: 7,
            lent: 0,
        },
        Case {
            // A higher band may take what the lower band's steady flows would need.
            what: "band 0 over band 1",
            limit: 64,
            steady: vec![("a", banded(2, 1), 18), ("c", banded(2, 1), 9)],
            burst: banded(1, 0),
            granted: 64 - 27,
            held: 0,
            lent: 64 - 27 - 12,
        },
        Case {
            // ... and the lower band is held back for the higher band's.
            what: "band 1 under band 0",
            limit: 64,
            steady: vec![("a", banded(2, 0), 18), ("c", banded(2, 0), 9)],
            burst: banded(1, 1),
            granted: 28,
            held: 9,
            lent: 28 - 12,
        },
        Case {
            // A reservation is a promise: 40 slots whatever the headroom.
            what: "reservation",
            limit: 64,
            steady: vec![("a", class(2), 18), ("c", class(2), 6)],
            burst: reserved(1, 40),
            granted: 40,
            held: 0,
            lent: 0,
        },
    ];
    for case in cases {
        let (mut q, _) = steady(case.limit, &case.steady);
        let got = grants(&mut q, "b", case.burst, 200);
        check_structure(&q);
        assert_eq!(
            (got, q.held(), q.lent()),
            (case.granted, case.held, case.lent),
            "{}: granted, held, lent",
            case.what
        );
        // The steady flows' next requests go at once, up to what was held.
        for &(tenant, class, _) in &case.steady {
            if case.held > 0 {
                granted(q.submit(tenant, class, 1, 0));
            }
        }
        check_structure(&q);
    }
}

#[test]
fn a_burst_stays_a_burst_after_its_mean_catches_up() {
    // Seed 000: A (2) and C (2) steady at 18 and 9 of 64, B (1) bursts and fills all it may
    // (28: its share and what A and C will not need), with two more queued.
    let (mut q, start) = steady(64, &[("a", class(2), 18), ("c", class(2), 9)]);
    let held_alone = q.held();
    assert_eq!(
        held_alone, 16,
        "A's and C's spread, with nothing else in flight"
    );
    assert_eq!(grants(&mut q, "b", class(1), 28), 28);
    let waiting = [
        queued(q.submit("b", class(1), 1, 1)),
        queued(q.submit("b", class(1), 1, 2)),
    ];
    let held = q.held();
    assert_eq!(held, 9);
    for entry in waiting {
        assert!(q.cancel(entry).is_some());
    }
    // Three windows on, with B held back every second (a request queued, then gone at its
    // deadline), its mean has caught up with its 28 slots: by its mean alone it is no longer
    // bursting. Its next request, with its queue empty, still finds the held slots kept.
    for second in 1..=30 {
        q.advance(start + Duration::from_secs(second));
        let entry = queued(q.submit("b", class(1), 1, 3));
        assert!(q.cancel(entry).is_some());
    }
    let b = q.by_name["b"];
    assert!(!q.bursting(q.flow(b), 29), "B's mean has caught up");
    let last = queued(q.submit("b", class(1), 1, 4));
    assert_eq!((q.in_flight(), q.held()), (55, held));
    check_structure(&q);
    // The burst ends: its slots come back, the last ones within its fair share, and its mean
    // does not stay behind as demand to protect (it was held back a moment ago): what is held
    // is A's and C's again.
    assert!(q.cancel(last).is_some());
    let b_key = q.flow_key(b);
    for _ in 0..28 {
        q.release(b_key);
    }
    assert!(!q.by_name.contains_key("b"));
    assert_eq!((q.in_flight(), q.held()), (27, held_alone));
    check_structure(&q);

    // A tenant with that same load that was never held back is steady: A at 36 of 64 beside C,
    // above its weight's share (25.6 once B is present), takes a held slot, and it is not lent
    // (the first version lent it, beyond A's weight's share).
    let (mut q, _) = steady(
        64,
        &[("a", class(2), 36), ("c", class(2), 9), ("b", class(1), 1)],
    );
    assert!(q.held() > 0);
    granted(q.submit("a", class(2), 1, 0));
    assert_eq!(q.lent(), 0);
    check_structure(&q);
}

#[test]
fn slots_for_arrivals_are_the_fewest_an_mm1k_queue_misses_with_at_most_the_chance() {
    // (arrivals per release, or the part of the limit the fleet's tenants below the level
    // hold; miss chance) → slots: the fleet's standby slots at its default 5 % miss, and the
    // headroom's at 3 σ (0.13 %).
    let rows = [
        (0.0, 0.05, 1),
        (0.1, 0.05, 2),
        (0.25, 0.05, 2),
        (0.33, 0.05, 3),
        (0.5, 0.05, 4),
        (0.5, 0.2, 2),
        (0.9, 0.05, 11),
        (0.99, 0.05, 14),
        (f64::NAN, 0.05, 1),
        (0.33, 1.0, 0),
        (27.0 / 55.0, normal_tail(3.0), 9),
        (44.0 / 134.0, normal_tail(3.0), 6),
    ];
    for (rho, miss, expected) in rows {
        assert_eq!(slots_for_arrivals(rho, miss), expected, "{rho} {miss}");
    }
    // The M/M/1/k chance that all k are taken, summed the long way, against the closed form.
    let full = |rho: f64, k: u32| {
        let weights: Vec<f64> = (0..=k).map(|n| rho.powi(n as i32)).collect();
        weights[k as usize] / weights.iter().sum::<f64>()
    };
    for rho in [0.01, 0.1, 0.25, 1.0 / 3.0, 0.43, 0.5, 0.7, 0.9, 0.95] {
        for miss in [0.2, 0.05, 0.005, normal_tail(3.0), 1e-6] {
            let k = slots_for_arrivals(rho, miss);
            assert!(full(rho, k) <= miss, "{rho} {miss}: {k} reach it");
            assert!(
                k == 1 || full(rho, k - 1) > miss,
                "{rho} {miss}: {k} - 1 would"
            );
        }
    }
    // Clamps: no arrivals still hold one; nearly every release taken holds what 0.95 does;
    // a miss of 1 holds nothing.
    assert_eq!(slots_for_arrivals(0.0, 0.005), 1);
    assert_eq!(slots_for_arrivals(f64::NAN, 0.005), 1);
    assert_eq!(
        slots_for_arrivals(3.0, 0.005),
        slots_for_arrivals(0.95, 0.005)
    );
    assert_eq!(slots_for_arrivals(0.5, 1.0), 0);
}

#[test]
fn the_normal_tail_is_the_chance_beyond_so_many_sigmas() {
    // One-sided tails of the standard normal, to the 1.5e-7 of Abramowitz and Stegun 7.1.26.
    for (sigmas, tail) in [
        (0.0, 0.5),
        (1.0, 0.158_655_25),
        (2.0, 0.022_750_13),
        (3.0, 0.001_349_90),
        (-1.0, 0.5),
    ] {
        let got = normal_tail(sigmas);
        assert!((got - tail).abs() < 2e-7, "{sigmas}: {got} against {tail}");
    }
}

#[test]
fn a_fleet_member_holds_the_deployments_spread() {
    // Seed 000's A (18) and C (9) on a replica of 64: ceil(27 + 3 √27) - 27 = 16 held alone.
    // As one of three replicas of 192, the margin is 3 / √3 standard deviations:
    // ceil(27 + 1.73 √27) - 27 = 9. (The deployment holds about 3 × 9 for three such
    // replicas, what one replica with all of their demand would hold, 3 √81 = 27.)
    let (mut q, _) = steady(64, &[("a", class(2), 18), ("c", class(2), 9)]);
    assert_eq!(q.held(), 16);
    q.set_global_limit(64);
    assert_eq!(q.held(), 16, "its own limit: alone");
    q.set_global_limit(192);
    assert_eq!(q.held(), 9);
    assert_eq!(grants(&mut q, "b", class(1), 200), 64 - 27 - 9);
    check_structure(&q);
}

#[test]
fn without_headroom_a_burst_takes_every_free_slot() {
    let mut q = FairQueue::new(64);
    for _ in 0..27 {
        granted(q.submit("a", class(2), 1, 0u32));
    }
    assert_eq!(grants(&mut q, "b", class(1), 200), 64 - 27);
    queued(q.submit("a", class(2), 1, 0));
}

#[test]
fn held_slots_go_to_the_steady_flow_and_decay_when_it_goes_quiet() {
    let (mut q, now) = steady(64, &[("a", class(2), 27)]);
    // B (weight 1): fair share 64 / 3 = 21.3; A's arrivals per release need 9 free (as in
    // seed 000's table row, for the same 27).
    let b = class(1);
    let b_grants = grants(&mut q, "b", b, 40);
    assert_eq!((b_grants, q.held()), (64 - 27 - 9, 9));
    // B's requests wait beside the free slots; A's go first, at once, and with one slot left
    // free, B's still wait.
    assert_eq!(q.queued(), 40 - b_grants);
    for _ in 0..8 {
        granted(q.submit("a", class(2), 1, 0));
    }
    assert_eq!((q.in_flight(), q.dispatch_next().map(|_| ())), (63, None));

    // A finishes everything and sends nothing more: after a few windows its mean has
    // decayed and B takes every free slot.
    let a_key = q.by_name.get("a").map(|&index| q.flow_key(index)).unwrap();
    for _ in 0..(27 + 8) {
        q.release(a_key);
    }
    q.advance(now + HEADROOM.window * 8);
    let mut dispatched = 0;
    while q.dispatch_next().is_some() {
        dispatched += 1;
    }
    assert_eq!(dispatched, 40 - b_grants);
    assert_eq!(grants(&mut q, "b", b, 100), 64 - 40);
    assert_eq!(q.held(), 0);
    check_structure(&q);
}

#[test]
fn with_headroom_backlogged_shares_still_follow_weights() {
    let (mut q, now) = steady(32, &[]);
    let mut served = [0u32; 2];
    let classes = [("a", class(2)), ("b", class(1))];
    let mut held: VecDeque<(usize, FlowKey)> = VecDeque::new();
    for (i, (tenant, class)) in classes.iter().enumerate() {
        for _ in 0..40 {
            if let Submit::Granted(key) = q.submit(tenant, *class, 1, i as u32) {
                held.push_back((i, key));
            }
        }
    }
    for step in 0..3_000u32 {
        q.advance(now + Duration::from_millis(u64::from(step) * 10));
        let (_, key) = held.pop_front().expect("slots in flight");
        q.release(key);
        while let Some((key, tenant)) = q.dispatch_next() {
            let tenant = tenant as usize;
            served[tenant] += 1;
            held.push_back((tenant, key));
            // Keep both backlogged.
            let (name, class) = classes[tenant];
            queued(q.submit(name, class, 1, tenant as u32));
        }
    }
    check_structure(&q);
    assert_shares(
        "2:1 with headroom",
        &[u64::from(served[0]), u64::from(served[1])],
        &[2, 1],
    );
    assert_eq!(q.held(), 0, "backlogged flows leave nothing free");
}

/// Random submits, releases and cancels against a queue, with the bookkeeping to check that
/// every payload comes back exactly once.
#[derive(Default)]
struct Driver {
    held: Vec<FlowKey>,
    waiting: Vec<(EntryKey, u64)>,
    returned: BTreeSet<u64>,
    submitted: usize,
}

impl Driver {
    /// For `roll` below 88: a submit (45 in 100), a release (35) or a cancel (8), if there is
    /// one to make; whether it made one.
    fn step(&mut self, q: &mut FairQueue<u64>, rng: &mut Lcg, id: u64, roll: u64) -> bool {
        if roll < 45 {
            let tenant = TENANTS[rng.below(TENANTS.len() as u64) as usize];
            let class = random_class(rng);
            self.submitted += 1;
            match q.submit(tenant, class, 1 + rng.below(3), id) {
                Submit::Granted(key) => {
                    self.returned.insert(id);
                    self.held.push(key);
                }
                Submit::Queued(entry) => self.waiting.push((entry, id)),
                Submit::Full(payload) => assert!(self.returned.insert(payload)),
            }
        } else if roll < 80 && !self.held.is_empty() {
            let key = self
                .held
                .swap_remove(rng.below(self.held.len() as u64) as usize);
            q.release(key);
        } else if roll < 88 && !self.waiting.is_empty() {
            let (entry, id) = self
                .waiting
                .swap_remove(rng.below(self.waiting.len() as u64) as usize);
            if let Some(payload) = q.cancel(entry) {
                assert_eq!(payload, id);
                assert!(self.returned.insert(payload));
            }
        } else {
            return false;
        }
        true
    }

    /// Dispatches all that may run now: never past the limit, nor past what was in flight
    /// `before` (a lowered limit preempts nothing).
    fn dispatch(&mut self, q: &mut FairQueue<u64>, before: u32, seed: u64) {
        while let Some((key, payload)) = q.dispatch_next() {
            assert!(
                self.returned.insert(payload),
                "payload {payload} handed back twice"
            );
            self.waiting.retain(|&(_, id)| id != payload);
            self.held.push(key);
        }
        assert!(
            q.in_flight() <= before.max(q.limit()),
            "seed {seed}: {} in flight, limit {}",
            q.in_flight(),
            q.limit()
        );
    }

    /// Every submitted payload came back once or still waits, and the queue agrees.
    fn finish(&self, q: &FairQueue<u64>) {
        assert_eq!(self.returned.len() + self.waiting.len(), self.submitted);
        assert_eq!(q.queued() as usize, self.waiting.len());
    }
}

/// Random operations with headroom on and time passing: the structure stays consistent (sums,
/// keys, lent slots), nothing is granted at or above the limit, every payload comes back
/// exactly once, and when the queue settles with slots free, what waits is held back.
#[test]
fn random_operations_with_headroom_keep_the_invariants() {
    let mut paced_seen = 0;
    for (seed, headroom) in
        (0..40u64).map(|seed| (seed, if seed % 2 == 0 { HEADROOM } else { PACED }))
    {
        let mut rng = Lcg(seed);
        let start = Instant::now();
        let mut clock = start;
        let mut q: FairQueue<u64> = FairQueue::with_headroom(1 + rng.below(40) as u32, headroom);
        q.advance(clock);
        let mut driver = Driver::default();
        for id in 0..3_000u64 {
            let roll = rng.below(100);
            let before = q.in_flight().max(q.limit());
            if driver.step(&mut q, &mut rng, id, roll) {
                // A submit, a release or a cancel.
            } else if roll < 94 {
                clock += Duration::from_millis(rng.below(4_000));
                q.advance(clock);
            } else {
                q.set_limit(rng.below(40) as u32);
            }
            driver.dispatch(&mut q, before, seed);
            if q.in_flight() < q.limit && q.queued() > 0 {
                let first = q.order.first().expect("something waits").flow;
                assert!(
                    q.held_back(first),
                    "seed {seed}: a free slot and a runnable head"
                );
                // Every flow the dispatch looked at and left for its pace alone is one the
                // caller is told when to dispatch again, no later than its time.
                let key = *q.order.first().expect("something waits");
                let looked: Vec<u32> = std::iter::once(first)
                    .chain(
                        q.look_past_paced(&key, q.hold_back(first))
                            .map(|key| key.flow),
                    )
                    .collect();
                for index in looked {
                    if q.hold_back(index) == Some(HoldBack::Pace) {
                        paced_seen += 1;
                        let until = q.paced_until(q.flow(index)).expect("paced");
                        assert!(
                            q.next_pace_at().is_some_and(|at| at > clock && at <= until),
                            "seed {seed}: no wake-up for a paced flow"
                        );
                    }
                }
            }
            check_structure(&q);
        }
        driver.finish(&q);
    }
    assert!(paced_seen > 0, "pacing is exercised");
}

#[test]
fn with_more_tenants_than_slots_the_budget_never_idles_while_requests_wait() {
    // One slot, three tenants: each one's fair share is a third of a slot. When the only
    // request in flight finishes, nothing else would ever release one, so nothing is held.
    let (mut q, now) = steady(1, &[]);
    let a = granted(q.submit("a", class(1), 1, 0));
    queued(q.submit("b", class(1), 1, 1));
    queued(q.submit("c", class(1), 1, 2));
    q.advance(now + HEADROOM.window);
    q.release(a);
    assert_eq!(q.dispatch_next().map(|(_, id)| id), Some(1));
    check_structure(&q);
    // Fifty steady tenants on fifty slots, ten more waiting: each fair share is 5/6 of a slot,
    // yet a newcomer's first slot is not lent, so a slot that frees goes to one at once.
    let names: Vec<String> = (0..60).map(|i| format!("t{i}")).collect();
    let steady_flows: Vec<(&str, FlowClass, u32)> = names[..50]
        .iter()
        .map(|n| (n.as_str(), class(1), 1))
        .collect();
    let (mut q, _) = steady(50, &steady_flows);
    for name in &names[50..] {
        queued(q.submit(name, class(1), 1, 7));
    }
    let t0 = q.by_name.get("t0").map(|&index| q.flow_key(index)).unwrap();
    q.release(t0);
    assert_eq!(q.dispatch_next().map(|(_, id)| id), Some(7));
    check_structure(&q);
}

fn fleet_share(weight: u32, standby: bool) -> Share {
    Share {
        weight: weight * SHARE_SCALE,
        reserved_slots: 0,
        standby,
    }
}

#[test]
fn standby_slots_are_kept_for_the_tenants_the_fleet_gives_all_they_ask() {
    // A replica's share of 12, 3 of them standby: the fleet gives "a" all it asks, "b" is at
    // the water level; "c" is new to the fleet.
    let mut q: FairQueue<u32> = FairQueue::new(12);
    q.set_shares(
        [
            (TenantKey::of("a"), fleet_share(2, true)),
            (TenantKey::of("b"), fleet_share(1, false)),
        ]
        .into(),
    );
    q.set_standby(3);
    assert_eq!(q.standby(), 3);
    // b floods: it takes all but the standby slots and waits beside them.
    assert_eq!(grants(&mut q, "b", class(1), 20), 9);
    assert_eq!((q.in_flight(), q.queued()), (9, 11));
    assert_eq!(q.dispatch_next(), None, "b never takes a standby slot");
    // a's requests run at once on the standby slots, and so does a tenant the fleet has not
    // seen yet.
    assert_eq!(grants(&mut q, "a", class(2), 2), 2);
    assert_eq!(grants(&mut q, "c", class(1), 1), 1);
    assert_eq!(q.in_flight(), 12);
    check_structure(&q);

    // A release refills the standby slots before b gets any: b runs only once more than 3 are
    // free.
    let b = q.by_name["b"];
    let b_key = q.flow_key(b);
    for freed in 1..=3 {
        q.release(b_key);
        assert_eq!(q.dispatch_next(), None, "{freed} free: standby");
    }
    q.release(b_key);
    assert!(q.dispatch_next().is_some(), "4 free: b takes one");
    assert_eq!(q.dispatch_next(), None);

    // While b waits beside the standby slots, a's queued request jumps it: the standby order.
    let mut q: FairQueue<u32> = FairQueue::new(8);
    q.set_shares(
        [
            (TenantKey::of("a"), fleet_share(1, true)),
            (TenantKey::of("b"), fleet_share(1, false)),
        ]
        .into(),
    );
    // b took every slot before the standby slots were kept (it has not yet given any back).
    let holders: Vec<FlowKey> = (0..8)
        .map(|_| granted(q.submit("b", class(1), 1, 0)))
        .collect();
    q.set_standby(2);
    queued(q.submit("b", class(1), 1, 1));
    queued(q.submit("a", class(1), 1, 2));
    q.release(holders[0]);
    assert_eq!(q.dispatch_next().map(|(_, p)| p), Some(2), "a first");
    check_structure(&q);

    // Turned off, b takes what is free at once.
    q.release(holders[1]);
    assert_eq!(q.dispatch_next(), None);
    q.set_standby(0);
    assert_eq!(q.dispatch_next().map(|(_, p)| p), Some(1));
    check_structure(&q);

    // Never more than a quarter of the limit, and nothing held with nothing in flight.
    let mut q: FairQueue<u32> = FairQueue::new(4);
    q.set_shares([(TenantKey::of("b"), fleet_share(1, false))].into());
    q.set_standby(10);
    assert_eq!(q.standby(), 1);
    assert_eq!(grants(&mut q, "b", class(1), 4), 3);
    let mut q: FairQueue<u32> = FairQueue::new(2);
    q.set_shares([(TenantKey::of("b"), fleet_share(1, false))].into());
    q.set_standby(2);
    assert_eq!(q.standby(), 0);
    assert_eq!(grants(&mut q, "b", class(1), 2), 2);
}

#[test]
fn random_operations_with_standby_slots_keep_the_invariants() {
    for seed in 0..20u64 {
        let mut rng = Lcg(seed);
        let mut q: FairQueue<u64> = FairQueue::new(1 + rng.below(40) as u32);
        let mut driver = Driver::default();
        for id in 0..3_000u64 {
            let roll = rng.below(100);
            let before = q.in_flight().max(q.limit());
            if driver.step(&mut q, &mut rng, id, roll) {
                // A submit, a release or a cancel.
            } else if roll < 92 {
                // The fleet's verdicts change: some tenants at the level, some below, some unseen.
                let mut shares = HashMap::new();
                for tenant in TENANTS {
                    if rng.chance(70) {
                        let weight = 1 + rng.below(3) as u32;
                        let standby = rng.chance(50);
                        shares.insert(TenantKey::of(tenant), fleet_share(weight, standby));
                    }
                }
                q.set_shares(shares);
            } else if roll < 96 {
                q.set_standby(rng.below(6) as u32);
            } else {
                q.set_limit(rng.below(40) as u32);
            }
            driver.dispatch(&mut q, before, seed);
            let free = q.limit().saturating_sub(q.in_flight());
            if free > 0 && q.queued() > 0 {
                // Slots stay free beside waiting requests only for want of a standby right.
                assert!(
                    free <= q.standby(),
                    "seed {seed}: {free} free beside a waiting request, standby {}",
                    q.standby()
                );
                let first = q.order.first().expect("something waits").flow;
                assert!(q.held_back(first), "seed {seed}: a runnable head left");
                let band = q.order.first().expect("something waits").band;
                assert!(
                    q.standby_order
                        .iter()
                        .filter(|key| key.band <= band)
                        .all(|key| q.held_back(key.flow)),
                    "seed {seed}: a flow with the standby right left waiting"
                );
            }
            check_structure(&q);
        }
        driver.finish(&q);
    }
}

// ---------------------------------------------------------------------------------------------
// Pacing a burst.

/// The headroom with pacing, as configured by default.
const PACED: Headroom = Headroom {
    pace: true,
    ..HEADROOM
};

/// A queue whose `flows` each hold their slots, one released and the next started every `hold
/// / slots`, for six windows: their means and the budget's turnover (slots in flight over
/// starts per second, so a slot is held `hold`) have converged. The churn runs unpaced (the
/// flows' own ramps would otherwise be paced while their means catch up) and `headroom` applies
/// from its end.
fn churning(
    limit: u32,
    headroom: Headroom,
    flows: &[(&'static str, FlowClass, u32)],
    hold: Duration,
) -> (FairQueue<u32>, Instant) {
    let start = Instant::now();
    let unpaced = Headroom {
        pace: false,
        ..headroom
    };
    let mut q = FairQueue::with_headroom(limit, unpaced);
    q.advance(start);
    let mut next = Vec::new();
    for &(tenant, class, slots) in flows {
        let keys: Vec<FlowKey> = (0..slots)
            .map(|_| granted(q.submit(tenant, class, 1, 0)))
            .collect();
        let every = hold / slots;
        next.push((start + every, every, tenant, class, keys[0]));
    }
    let end = start + headroom.window * 6;
    while let Some(i) = (0..next.len()).min_by_key(|&i| next[i].0)
        && next[i].0 <= end
    {
        let (at, every, tenant, class, key) = next[i];
        q.advance(at);
        q.release(key);
        let key = granted(q.submit(tenant, class, 1, 0));
        next[i] = (at + every, every, tenant, class, key);
    }
    q.advance(end);
    q.headroom = Some(headroom);
    (q, end)
}

#[test]
fn a_burst_beside_steady_tenants_starts_at_the_pace_of_a_steady_tenant_at_its_share() {
    struct Case {
        what: &'static str,
        headroom: Headroom,
        steady: Vec<(&'static str, FlowClass, u32)>,
        burst: FlowClass,
        /// The burst's requests granted at once, of 40.
        granted: u32,
        /// The pace after that, in ms, within 10 %: `None` when nothing is paced.
        pace_ms: Option<f64>,
    }
    // Seed 000's shape: A and C (weight 2) hold 16 and 8 of 64, each slot for 2 s; B (1) bursts.
    // B's fair share is 64 / 5 = 12.8, so its pace is 2 s / 12.8 = 156 ms, with a tolerance of
    // 3 (the margin's sigmas) starts ahead of it: 4 at once, then one per pace.
    let seed000 = || vec![("a", class(2), 16), ("c", class(2), 8)];
    let cases = [
        Case {
            what: "seed 000: 1 + 3 slots at once, then one per 156 ms",
            headroom: PACED,
            steady: seed000(),
            burst: class(1),
            granted: 4,
            pace_ms: Some(156.0),
        },
        Case {
            // The steady flows' arrivals, 24 / 56 = 0.43 per release, find 8 free slots all
            // taken 0.13 % of the time (their spread would hold 15): B fills 64 - 24 - 8 = 32
            // at once.
            what: "without pacing: all the headroom leaves, at once",
            headroom: HEADROOM,
            steady: seed000(),
            burst: class(1),
            granted: 32,
            pace_ms: None,
        },
        Case {
            // A weight of 4 of 8: a share of 32, a pace of 2 s / 32 = 62.5 ms.
            what: "a heavier burst's share is larger and its pace shorter",
            headroom: PACED,
            steady: seed000(),
            burst: class(4),
            granted: 4,
            pace_ms: Some(62.5),
        },
        Case {
            what: "alone: nobody to protect, the whole budget at once",
            headroom: PACED,
            steady: vec![],
            burst: class(1),
            granted: 40,
            pace_ms: None,
        },
        Case {
            // Below its reservation a flow is never held back, and those starts are not paced:
            // 6, then the 4 of any burst.
            what: "a reservation first",
            headroom: PACED,
            steady: seed000(),
            burst: reserved(1, 6),
            granted: 10,
            pace_ms: Some(156.0),
        },
        Case {
            // The steady flows are in band 1: nobody of B's band or above is protected.
            what: "a higher band than the steady tenants'",
            headroom: PACED,
            steady: vec![("a", banded(2, 1), 16), ("c", banded(2, 1), 8)],
            burst: banded(1, 0),
            granted: 40,
            pace_ms: None,
        },
    ];
    for case in cases {
        let (mut q, now) = churning(64, case.headroom, &case.steady, Duration::from_secs(2));
        let granted_now = grants(&mut q, "b", case.burst, 40);
        assert_eq!(granted_now, case.granted, "{}: granted at once", case.what);
        assert!(q.dispatch_next().is_none(), "{}", case.what);
        // The tolerance is to the nearest start (`sigmas + 0.5` paces), so the first paced start
        // comes half a pace after the ones at once, and each next one a pace after it.
        let ms = |from: Instant, to: Instant| to.duration_since(from).as_secs_f64() * 1000.0;
        let waits = q.next_pace_at().map(|first| {
            q.advance(first);
            assert!(
                q.dispatch_next().is_some(),
                "{}: runs at its time",
                case.what
            );
            let second = q.next_pace_at().expect("still paced");
            (ms(now, first), ms(first, second))
        });
        match (waits, case.pace_ms) {
            (Some((first, pace)), Some(want)) => assert!(
                (first - want / 2.0).abs() <= want * 0.05 && (pace - want).abs() <= want * 0.1,
                "{}: first after {first:.1} ms, then {pace:.1} ms, want {want} ms",
                case.what
            ),
            (None, None) => {}
            (got, want) => panic!("{}: waits {got:?}, want {want:?}", case.what),
        }
        // A steady tenant's next request, within its usual load, is never paced.
        if !case.steady.is_empty() && case.pace_ms.is_some() {
            let (tenant, class, _) = case.steady[0];
            granted(q.submit(tenant, class, 1, 0));
        }
    }
}

#[test]
fn a_paced_burst_reaches_its_fair_share_within_one_hold_time() {
    let hold = Duration::from_secs(2);
    let steady = [("a", class(2), 16), ("c", class(2), 8)];
    let (mut q, start) = churning(64, PACED, &steady, hold);
    // B's queue holds its burst (40 requests); 1 + 3 run at once.
    assert_eq!(grants(&mut q, "b", class(1), 40), 4);
    let mut held_by_b = 4;
    let mut starts = vec![Duration::ZERO];
    while let Some(at) = q.next_pace_at() {
        if at > start + hold {
            break;
        }
        // Nothing runs before its time...
        q.advance(at - Duration::from_millis(1));
        assert!(q.dispatch_next().is_none(), "dispatched before its pace");
        // ... and one request at it.
        q.advance(at);
        assert!(
            q.dispatch_next().is_some(),
            "paced request runs at its time"
        );
        assert!(q.dispatch_next().is_none(), "one per pace");
        held_by_b += 1;
        starts.push(at.duration_since(start));
    }
    // 4 and then 12.8 more in 2 s (one per 156 ms), where unpaced it took 25 at once; the
    // turnover moves as B's slots join, so a little either way.
    assert!(
        (15..=19).contains(&held_by_b),
        "B holds {held_by_b} after one hold time: {starts:?}"
    );
    assert_eq!(q.in_flight(), 24 + held_by_b);
}

#[test]
fn a_tenant_ramping_to_a_new_everyday_load_is_paced_but_not_held_back() {
    // Pacing does not mark a flow as held back, so once its mean catches up it is steady and
    // protected like any other (the headroom's "held back within the window" would instead keep
    // it a burst for a window).
    let hold = Duration::from_secs(2);
    let (mut q, now) = churning(64, PACED, &[("a", class(2), 8)], hold);
    assert_eq!(grants(&mut q, "c", class(2), 5), 4, "the fifth is paced");
    let c = q.by_name["c"];
    assert!(q.flow(c).held_back_at.is_none());
    let at = q.next_pace_at().expect("paced");
    assert!(at > now);
    q.advance(at);
    assert!(q.dispatch_next().is_some(), "the fifth runs at its pace");
    // C holds its 5 for three windows: its mean catches up, it is no longer bursting, and its
    // next request is granted at once and counted as protected.
    q.advance(at + HEADROOM.window * 3);
    granted(q.submit("c", class(2), 1, 0));
    assert!(
        q.flow(c).protected,
        "C is protected once its mean has caught up"
    );
    assert_eq!(q.paced(), 1);
}

#[test]
fn a_flow_that_ran_unpaced_waits_at_most_one_pace_when_it_bursts() {
    // A holds 40 slots, each for 2 s: 20 starts a second. Alone for a minute (its mean catches
    // up), then beside C (weight 2, two slots) for another: its share is 64 / 3 = 21, so its
    // pace is about 2 s / 21 = 94 ms, and each of its starts, none paced (it is steady), moves
    // its arrival time by that. Unbounded, that time would run ahead of the clock by about a
    // second a second.
    let mut q: FairQueue<u32> = FairQueue::with_headroom(64, PACED);
    let mut now = Instant::now();
    q.advance(now);
    let mut held: VecDeque<FlowKey> = (0..40)
        .map(|_| granted(q.submit("a", class(1), 1, 0)))
        .collect();
    for step in 0..2_400 {
        if step == 1_200 {
            granted(q.submit("c", class(2), 1, 0));
            granted(q.submit("c", class(2), 1, 0));
        }
        now += Duration::from_millis(50);
        q.advance(now);
        q.release(held.pop_front().expect("held"));
        held.push_back(granted(q.submit("a", class(1), 1, 0)));
    }
    let a = q.by_name["a"];
    assert_eq!(q.paced(), 0, "A is steady: never paced");
    let pace = q.pace(q.flow(a)).expect("a turnover");
    assert!(pace > Duration::from_millis(80), "{pace:?}");
    let next = q.flow(a).next_start_at.expect("a fair start");
    assert!(
        next <= now + pace,
        "A's next start is {:?} away, more than its pace of {pace:?}",
        next.duration_since(now)
    );
}

#[test]
fn a_flow_queued_behind_a_paced_burst_runs_beside_free_slots() {
    // Seed 000's heavy-steady stalled this way before the look-ahead: A, queued once, sat behind
    // B (paced, first in fair order and fewest slots per weight) beside free slots.
    let (mut q, _) = churning(
        64,
        PACED,
        &[("a", class(2), 20), ("c", class(2), 8)],
        Duration::from_secs(2),
    );
    assert_eq!(grants(&mut q, "b", class(1), 6), 4, "4 at once, 2 paced");
    // A keeps running its usual load, at once; its starts move the fair order's virtual time
    // past B's queued head.
    let a = q.by_name["a"];
    for _ in 0..10 {
        q.release(q.flow_key(a));
        assert!(q.dispatch_next().is_none(), "B is paced");
        granted(q.submit("a", class(2), 1, 0));
    }
    // A request of A's that finds no slot queues; then slots free up.
    q.set_limit(q.in_flight());
    queued(q.submit("a", class(2), 1, 7));
    q.set_limit(64);
    let b = q.by_name["b"];
    assert_eq!(q.order.first().map(|key| key.flow), Some(b), "B first");
    assert_eq!(q.by_usage.first().map(|key| key.flow), Some(b), "B fewest");
    assert!(q.paced_until(q.flow(b)).is_some());
    assert_eq!(q.dispatch_next().map(|(_, id)| id), Some(7), "A runs");
    assert!(q.dispatch_next().is_none(), "B still waits for its pace");
    check_structure(&q);
}
