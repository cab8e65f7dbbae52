//! The facade's guarantees: a permit frees its slot exactly once and hands it on; a ticket
//! dropped while queued gives its place up and takes nothing, even when it loses a race with
//! the slot arriving.

use std::time::Duration;

use super::*;

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

fn load(in_flight: u32, queued: u32, limit: u32) -> Load {
    Load {
        limit,
        in_flight,
        queued,
    }
}

#[tokio::test(start_paused = true)]
async fn a_dropped_permit_hands_its_slot_to_the_next_in_line() {
    let scheduler = Scheduler::new(1);
    let first = now(scheduler.submit("a", class(4), 1));
    let mut second = queued(scheduler.submit("b", class(4), 1));
    assert_eq!(scheduler.load(), load(1, 1, 1));
    drop(first);
    let permit = tokio::time::timeout(Duration::from_secs(1), second.granted())
        .await
        .expect("the freed slot goes to the waiting ticket");
    assert_eq!(scheduler.load(), load(1, 0, 1));
    drop(permit);
    assert_eq!(scheduler.load(), load(0, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_ticket_frees_its_place_and_takes_nothing() {
    let scheduler = Scheduler::new(1);
    let holder = now(scheduler.submit("a", class(1), 1));
    let ticket = queued(scheduler.submit("b", class(1), 1));
    assert!(matches!(scheduler.submit("b", class(1), 1), Admit::Full));
    drop(ticket);
    assert_eq!(scheduler.load(), load(1, 0, 1));
    let _again = queued(scheduler.submit("b", class(1), 1));
    drop(holder);
    assert_eq!(
        scheduler.load(),
        load(1, 0, 1),
        "the new ticket got the slot"
    );
}

#[tokio::test(start_paused = true)]
async fn a_slot_sent_to_a_ticket_that_gave_up_is_released() {
    let scheduler = Scheduler::new(1);
    let holder = now(scheduler.submit("a", class(4), 1));
    let ticket = queued(scheduler.submit("b", class(4), 1));
    // The slot is dispatched into the ticket's channel, but the ticket is dropped unread.
    drop(holder);
    assert_eq!(scheduler.load(), load(1, 0, 1));
    drop(ticket);
    assert_eq!(scheduler.load(), load(0, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn raising_the_limit_admits_waiting_requests_and_lowering_it_preempts_nothing() {
    let scheduler = Scheduler::new(1);
    let first = now(scheduler.submit("a", class(4), 1));
    let mut waiting: Vec<Ticket> = (0..3)
        .map(|_| queued(scheduler.submit("b", class(4), 1)))
        .collect();
    scheduler.set_limit(3);
    let mut permits = Vec::new();
    for ticket in waiting.iter_mut().take(2) {
        permits.push(ticket.granted().await);
    }
    assert_eq!(scheduler.load(), load(3, 1, 3));
    scheduler.set_limit(1);
    assert_eq!(
        scheduler.load(),
        load(3, 1, 1),
        "in-flight requests keep their slots"
    );
    drop(permits);
    drop(first);
    assert_eq!(
        scheduler.load(),
        load(1, 0, 1),
        "the last waiter got the one slot left"
    );
}

#[tokio::test(start_paused = true)]
async fn peak_in_flight_covers_the_whole_period() {
    let scheduler = Scheduler::new(8);
    let permits: Vec<Permit> = (0..5)
        .map(|_| now(scheduler.submit("a", class(0), 1)))
        .collect();
    drop(permits);
    assert_eq!(
        scheduler.take_peak_in_flight(),
        5,
        "the burst is seen after it ended"
    );
    assert_eq!(scheduler.take_peak_in_flight(), 0);
}
