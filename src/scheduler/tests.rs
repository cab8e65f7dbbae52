//! The facade's guarantees: a permit frees its slot exactly once and hands it on; a ticket
//! dropped while queued gives its place up and takes nothing, even when it loses a race with
//! the slot arriving.

use std::time::Duration;

use super::*;

/// No cap on queued body bytes, for the tests that are not about it.
const UNCAPPED: usize = usize::MAX;

fn class(queue_max: u32) -> FlowClass {
    FlowClass {
        weight: 1,
        band: 0,
        queue_max,
        reserved_slots: 0,
    }
}

fn now(admit: Admit) -> Permit {
    match admit {
        Admit::Now(permit) => permit,
        _ => panic!("expected a free slot"),
    }
}

fn queued(admit: Admit) -> Ticket {
    match admit {
        Admit::Queued(ticket) => ticket,
        _ => panic!("expected to queue"),
    }
}

/// The scheduler's load, its count of releases aside (the tests that count them say so).
fn slots(scheduler: &Scheduler) -> Load {
    Load {
        released: 0,
        ..scheduler.load()
    }
}

fn load(in_flight: u32, queued: u32, limit: u32) -> Load {
    Load {
        limit,
        global_limit: limit,
        in_flight,
        queued,
        queued_body_bytes: 0,
        held: 0,
        lent: 0,
        standby: 0,
        paced: 0,
        released: 0,
    }
}

#[tokio::test(start_paused = true)]
async fn a_dropped_permit_hands_its_slot_to_the_next_in_line() {
    let scheduler = Scheduler::new(1, UNCAPPED, None);
    let first = now(scheduler.submit("a", class(4), 1, 0));
    let mut second = queued(scheduler.submit("b", class(4), 1, 0));
    assert_eq!(slots(&scheduler), load(1, 1, 1));
    drop(first);
    let permit = tokio::time::timeout(Duration::from_secs(1), second.granted())
        .await
        .expect("the freed slot goes to the waiting ticket");
    assert_eq!(slots(&scheduler), load(1, 0, 1));
    assert_eq!(scheduler.load().released, 1);
    drop(permit);
    assert_eq!(slots(&scheduler), load(0, 0, 1));
    assert_eq!(
        scheduler.load().released,
        2,
        "each stream's end counted once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_ticket_frees_its_place_and_takes_nothing() {
    let scheduler = Scheduler::new(1, UNCAPPED, None);
    let holder = now(scheduler.submit("a", class(1), 1, 0));
    let ticket = queued(scheduler.submit("b", class(1), 1, 0));
    assert!(matches!(scheduler.submit("b", class(1), 1, 0), Admit::Full));
    drop(ticket);
    assert_eq!(slots(&scheduler), load(1, 0, 1));
    let _again = queued(scheduler.submit("b", class(1), 1, 0));
    drop(holder);
    assert_eq!(
        slots(&scheduler),
        load(1, 0, 1),
        "the new ticket got the slot"
    );
}

#[tokio::test(start_paused = true)]
async fn a_slot_sent_to_a_ticket_that_gave_up_is_released() {
    let scheduler = Scheduler::new(1, UNCAPPED, None);
    let holder = now(scheduler.submit("a", class(4), 1, 0));
    let ticket = queued(scheduler.submit("b", class(4), 1, 0));
    // The slot is dispatched into the ticket's channel, but the ticket is dropped unread.
    drop(holder);
    assert_eq!(slots(&scheduler), load(1, 0, 1));
    drop(ticket);
    assert_eq!(slots(&scheduler), load(0, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn raising_the_limit_admits_waiting_requests_and_lowering_it_preempts_nothing() {
    let scheduler = Scheduler::new(1, UNCAPPED, None);
    let first = now(scheduler.submit("a", class(4), 1, 0));
    let mut waiting: Vec<Ticket> = (0..3)
        .map(|_| queued(scheduler.submit("b", class(4), 1, 0)))
        .collect();
    scheduler.set_limit(3);
    let mut permits = Vec::new();
    for ticket in waiting.iter_mut().take(2) {
        permits.push(ticket.granted().await);
    }
    assert_eq!(slots(&scheduler), load(3, 1, 3));
    scheduler.set_limit(1);
    assert_eq!(
        slots(&scheduler),
        load(3, 1, 1),
        "in-flight requests keep their slots"
    );
    drop(permits);
    drop(first);
    assert_eq!(
        slots(&scheduler),
        load(1, 0, 1),
        "the last waiter got the one slot left"
    );
}

#[tokio::test(start_paused = true)]
async fn peak_in_flight_covers_the_whole_period() {
    let scheduler = Scheduler::new(8, UNCAPPED, None);
    let permits: Vec<Permit> = (0..5)
        .map(|_| now(scheduler.submit("a", class(0), 1, 0)))
        .collect();
    drop(permits);
    assert_eq!(
        scheduler.take_peak_in_flight(),
        5,
        "the burst is seen after it ended"
    );
    assert_eq!(scheduler.take_peak_in_flight(), 0);
}

#[test]
fn queued_bodies_hold_bytes_up_to_the_cap_and_not_one_more() {
    // (cap, held before, bytes asked) -> fits, held after
    let table: [(usize, usize, usize, bool, usize); 7] = [
        (100, 0, 100, true, 100),
        (100, 0, 101, false, 0),
        (100, 60, 40, true, 100),
        (100, 60, 41, false, 60),
        (100, 100, 0, true, 100),
        (0, 0, 0, true, 0),
        // An overflowing sum is over any cap, not a wrap to a small total.
        (usize::MAX, usize::MAX - 1, 2, false, usize::MAX - 1),
    ];
    for (cap, held, bytes, fits, held_after) in table {
        let mut bodies = QueuedBodies { held, cap };
        assert_eq!(
            (bodies.try_hold(bytes), bodies.held),
            (fits, held_after),
            "cap {cap}, held {held}, asking {bytes}"
        );
    }
    let mut bodies = QueuedBodies { held: 70, cap: 100 };
    bodies.release(30);
    assert_eq!(bodies.held, 40);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_take_queued_bodies_over_the_cap_is_refused_and_takes_nothing() {
    let scheduler = Scheduler::new(1, 1_000, None);
    // A request that runs at once holds nothing in the queue, however large its body.
    let holder = now(scheduler.submit("a", class(8), 1, 5_000));
    assert_eq!(scheduler.load().queued_body_bytes, 0);
    let first = queued(scheduler.submit("b", class(8), 1, 600));
    let second = queued(scheduler.submit("c", class(8), 1, 400));
    assert_eq!(scheduler.load().queued_body_bytes, 1_000);
    assert!(matches!(
        scheduler.submit("d", class(8), 1, 1),
        Admit::BytesFull
    ));
    assert_eq!(
        slots(&scheduler),
        Load {
            queued_body_bytes: 1_000,
            ..load(1, 2, 1)
        },
        "the refused request left no entry and no bytes behind"
    );
    // The tenant's own queue limit is checked first: a full queue says so, whatever the bytes.
    let scheduler_b = Scheduler::new(1, 1_000, None);
    let _held = now(scheduler_b.submit("a", class(1), 1, 0));
    let _waiting = queued(scheduler_b.submit("a", class(1), 1, 1_000));
    assert!(matches!(
        scheduler_b.submit("a", class(1), 1, 1),
        Admit::Full
    ));
    drop((holder, first, second));
}

#[tokio::test(start_paused = true)]
async fn a_ticket_gives_its_body_bytes_back_however_it_leaves_the_queue() {
    let scheduler = Scheduler::new(1, 1_000, None);
    let holder = now(scheduler.submit("a", class(8), 1, 0));
    let cancelled = queued(scheduler.submit("b", class(8), 1, 300));
    let mut granted = queued(scheduler.submit("c", class(8), 1, 500));
    let raced = queued(scheduler.submit("d", class(8), 1, 200));
    assert_eq!(scheduler.load().queued_body_bytes, 1_000);

    // Gone while waiting (client gone, deadline, shutdown all drop the ticket).
    drop(cancelled);
    assert_eq!(scheduler.load().queued_body_bytes, 700);

    // Granted: the bytes stay counted until the ticket drops, then go back once.
    drop(holder);
    let permit = granted.granted().await;
    assert_eq!(scheduler.load().queued_body_bytes, 700);
    drop(granted);
    assert_eq!(scheduler.load().queued_body_bytes, 200);

    // Sent a slot it never read: the slot and the bytes both come back.
    drop(permit);
    assert_eq!(
        slots(&scheduler),
        Load {
            queued_body_bytes: 200,
            ..load(1, 0, 1)
        }
    );
    drop(raced);
    assert_eq!(
        slots(&scheduler),
        load(0, 0, 1),
        "no slot and no bytes left"
    );
    // And the room is there again for the next one.
    let _holder = now(scheduler.submit("a", class(8), 1, 0));
    let _next = queued(scheduler.submit("e", class(8), 1, 1_000));
    assert_eq!(scheduler.load().queued_body_bytes, 1_000);
}

/// A 48-slot scheduler with the headroom (paced or not) and a steady tenant holding 12 slots,
/// one finishing and the next starting every `every`, `times` times: on tokio's paused clock,
/// its mean and the budget's turnover build up as time passes.
async fn with_a_steady_tenant(
    pace: bool,
    every: Duration,
    times: u32,
) -> (Arc<Scheduler>, Vec<Permit>) {
    let headroom = Headroom {
        window: Duration::from_secs(10),
        sigmas: 3.0,
        pace,
    };
    let scheduler = Scheduler::new(48, UNCAPPED, Some(headroom));
    let steady = class(8);
    let mut steady_permits: Vec<Permit> = (0..12)
        .map(|_| now(scheduler.submit("steady", steady, 1, 0)))
        .collect();
    for _ in 0..times {
        tokio::time::advance(every).await;
        steady_permits.remove(0);
        steady_permits.push(now(scheduler.submit("steady", steady, 1, 0)));
    }
    (scheduler, steady_permits)
}

/// The headroom through the facade, on tokio's paused clock: a steady tenant's means build up
/// as time passes, a burst then gets its fair share and what the steady tenant will not need,
/// the steady tenant's next requests go at once, and the burst's waiting requests run once
/// the steady tenant has gone quiet for long enough. Its requests waiting beside free slots
/// are no demand for the controller.
#[tokio::test(start_paused = true)]
async fn a_burst_cannot_take_the_slots_a_steady_tenant_is_about_to_need() {
    // A minute of steady load: one request finishes and one starts every second.
    let (scheduler, mut steady_permits) =
        with_a_steady_tenant(false, Duration::from_secs(1), 60).await;
    let steady = class(8);
    // 50 slots rather than 48: the steady tenant's mean is a hair under 12 (each second's
    // release comes an instant before the next start), and at 48 that hair moves where the
    // burst stops by one slot.
    scheduler.set_limit(50);

    // Fair shares 25 of 50 each. The steady tenant's spread may need ceil(12 + 3 √12) - 12 =
    // 11 more than it holds, but its arrivals, 12 / 45 = 0.27 per release, find 5 free slots
    // all taken only 0.13 % of the time: the burst gets its 25 and 8 lent, and its 34th waits
    // beside 5 free slots.
    let burst = class(2);
    let burst_permits: Vec<Permit> = (0..33)
        .map(|_| now(scheduler.submit("burst", burst, 1, 0)))
        .collect();
    let mut waiting = queued(scheduler.submit("burst", burst, 1, 0));
    let load = scheduler.load();
    assert_eq!((load.in_flight, load.held, load.lent), (45, 5, 8));
    assert_eq!(load.waiting_for_slot(), 0, "held back, not short of slots");
    for _ in 0..5 {
        steady_permits.push(now(scheduler.submit("steady", steady, 1, 0)));
    }

    // The steady tenant finishes and goes quiet; a few windows later the burst's waiting
    // request gets a slot at the next event (here, another of its requests arriving).
    steady_permits.clear();
    tokio::time::advance(Duration::from_secs(60)).await;
    let next = scheduler.submit("burst", burst, 1, 0);
    let _first = tokio::time::timeout(Duration::from_millis(1), waiting.granted())
        .await
        .expect("the waiting request runs first");
    // Nothing holds it back any more: the newcomer runs at once too (granted, or queued behind its
    // own tenant's request and dispatched with it).
    let _next = match next {
        Admit::Now(permit) => permit,
        Admit::Queued(mut ticket) => {
            tokio::time::timeout(Duration::from_millis(1), ticket.granted())
                .await
                .expect("the newcomer runs too")
        }
        _ => panic!("the newcomer was refused"),
    };
    assert_eq!(scheduler.load().queued, 0);
    drop(burst_permits);
}

/// Pacing through the facade, on tokio's paused clock: beside a steady tenant, a burst's first
/// four requests run at once and the next ones wait for their pace with slots free, each woken
/// by the scheduler's own timer (nothing else happens meanwhile), one per pace.
#[tokio::test(start_paused = true)]
async fn a_paced_burst_is_woken_at_its_pace_with_nothing_else_happening() {
    // A minute of steady load: 12 slots, each held 3 s (one finishes and one starts every
    // 250 ms).
    let (scheduler, _steady_permits) =
        with_a_steady_tenant(true, Duration::from_millis(250), 240).await;

    // The burst's share is 24 of 48 (equal weights): one start per 3 s / 24 = 125 ms, and 3
    // (the margin's sigmas) ahead of that pace: 4 at once.
    let burst = class(8);
    let _first: Vec<Permit> = (0..4)
        .map(|_| now(scheduler.submit("burst", burst, 1, 0)))
        .collect();
    let mut waiting: Vec<Ticket> = (0..4)
        .map(|_| queued(scheduler.submit("burst", burst, 1, 0)))
        .collect();
    assert_eq!(scheduler.load().in_flight, 16, "paced beside free slots");
    assert_eq!(scheduler.load().paced, 4);
    let mut permits = Vec::new();
    for (i, ticket) in waiting.iter_mut().enumerate() {
        // The first about half a pace after the four (the tolerance is to the nearest start),
        // each next a pace after the one before: a little under 125 ms, since the burst's own
        // starts shorten the turnover's hold (73, then 115, 113, 111 ms). Not before...
        let (not_before, by) = if i == 0 { (50, 90) } else { (95, 130) };
        assert!(
            tokio::time::timeout(Duration::from_millis(not_before), ticket.granted())
                .await
                .is_err(),
            "request {i} granted before its pace"
        );
        // ... and at it, with no release or arrival to dispatch it.
        permits.push(
            tokio::time::timeout(Duration::from_millis(by - not_before), ticket.granted())
                .await
                .unwrap_or_else(|_| panic!("request {i} not woken at its pace")),
        );
    }
    assert_eq!(scheduler.load().in_flight, 20);

    // A paced request given up leaves the wake-up to the next one: two wait for the same
    // time, the first is dropped, and the second runs at that time.
    let mut second_wave: Vec<Ticket> = (0..2)
        .map(|_| queued(scheduler.submit("burst", burst, 1, 0)))
        .collect();
    drop(second_wave.remove(0));
    let _runs = tokio::time::timeout(Duration::from_millis(130), second_wave[0].granted())
        .await
        .expect("the one left is woken at its pace");
    assert_eq!(scheduler.load().in_flight, 21);
    assert_eq!(scheduler.load().queued, 0);
}

#[tokio::test(start_paused = true)]
async fn a_fleet_members_standby_slots_go_to_the_tenant_given_all_it_asks() {
    let scheduler = Scheduler::new(8, UNCAPPED, None);
    let fleet_share = |standby| Share {
        weight: SHARE_SCALE,
        reserved_slots: 0,
        standby,
    };
    let shares = [
        (TenantKey::of("paying"), fleet_share(true)),
        (TenantKey::of("flood"), fleet_share(false)),
    ];
    scheduler.set_share(8, 24, Some(shares.into()), 2);
    let mut flood: Vec<Permit> = (0..6)
        .map(|_| now(scheduler.submit("flood", class(8), 1, 0)))
        .collect();
    let mut waiting = queued(scheduler.submit("flood", class(8), 1, 0));
    let load = scheduler.load();
    assert_eq!((load.in_flight, load.standby, load.queued), (6, 2, 1));
    assert_eq!(
        load.waiting_for_slot(),
        1,
        "kept from it, the standby slots are as good as taken: the controller's demand"
    );
    // The paying tenant runs at once beside the flood's waiting request.
    let paying = now(scheduler.submit("paying", class(8), 1, 0));
    // A release of the flood's refills the standby slot the paying tenant took ...
    drop(flood.remove(0));
    assert!(
        tokio::time::timeout(Duration::from_millis(1), waiting.granted())
            .await
            .is_err(),
        "the flood waits while only the standby slots are free"
    );
    // ... and with more free than the standby slots the flood takes one.
    drop(paying);
    let _granted = tokio::time::timeout(Duration::from_millis(1), waiting.granted())
        .await
        .expect("three free, two kept: the flood's request runs");
    // None kept any more: the flood takes the last two at once.
    scheduler.set_share(8, 24, None, 0);
    let _more = [
        now(scheduler.submit("flood", class(8), 1, 0)),
        now(scheduler.submit("flood", class(8), 1, 0)),
    ];
    assert_eq!(scheduler.load().standby, 0);
}
