use proptest::prelude::*;

use super::*;
use std::time::Duration;

use tokio::time::Instant;

use crate::scheduler::SHARE_SCALE;

/// Keeps no standby slots.
const NO_STANDBY: Standby = Standby {
    miss: 1.0,
    at_least: 0,
};

/// Keeps as many as reach a 5 % miss.
const STANDBY: Standby = Standby {
    miss: 0.05,
    at_least: 0,
};

/// A backlogged flow: `demand` requests waiting, none in flight.
fn flow(tenant: u64, weight: u32, demand: u32) -> FlowDemand {
    FlowDemand {
        tenant,
        weight,
        band: 0,
        reserved: 0,
        in_flight: 0,
        queued: demand,
        cost: 1,
    }
}

fn member<'a>(name: &'a str, flows: &'a [FlowDemand]) -> MemberLoad<'a> {
    MemberLoad {
        member: name,
        in_flight: 0,
        applied: 0,
        handed: None,
        flows,
    }
}

fn targets_of(shares: &[MemberShare]) -> Vec<u32> {
    shares.iter().map(|s| s.target).collect()
}

fn grants_of(shares: &[MemberShare]) -> Vec<u32> {
    shares.iter().map(|s| s.grant).collect()
}

/// Each member's standby slots.
fn standbys(limit: u32, members: &[MemberLoad<'_>], standby: Standby) -> Vec<u32> {
    divide(limit, members, standby)
        .shares
        .iter()
        .map(|s| s.standby)
        .collect()
}

fn weight(share: &MemberShare, tenant: u64) -> u32 {
    share.overrides[&TenantKey(tenant)].weight
}

#[test]
fn a_lone_replica_gets_the_whole_limit_and_no_overrides() {
    let flows = [flow(1, 1, 50)];
    for (flows, what) in [(&[][..], "idle"), (&flows[..], "busy")] {
        let shares = divide(6, &[member("a", flows)], NO_STANDBY).shares;
        assert_eq!(targets_of(&shares), [6], "{what}");
        assert_eq!(grants_of(&shares), [6], "{what}");
        assert!(shares[0].overrides.is_empty(), "{what}");
    }
}

#[test]
fn targets_divide_by_tenant_not_by_replica() {
    // Each row: limit, per member its flows (tenant, weight, demand), expected targets.
    type Row = (u32, Vec<Vec<(u64, u32, u32)>>, Vec<u32>);
    let rows: Vec<Row> = vec![
        // Idle: the limit is split evenly (largest remainder to the first).
        (6, vec![vec![], vec![]], vec![3, 3]),
        (7, vec![vec![], vec![], vec![]], vec![3, 2, 2]),
        // One tenant on one replica, backlogged: all of it goes there.
        (6, vec![vec![(1, 1, 50)], vec![], vec![]], vec![6, 0, 0]),
        // Tenant A only on replica 1, B on all three, equal weights: A gets half the limit,
        // B the other half over three replicas.
        (
            12,
            vec![
                vec![(1, 1, 50), (2, 1, 50)],
                vec![(2, 1, 50)],
                vec![(2, 1, 50)],
            ],
            vec![8, 2, 2],
        ),
        // Weight 3 against 1, each on its own replica.
        (8, vec![vec![(1, 3, 50)], vec![(2, 1, 50)]], vec![6, 2]),
        // A tenant wanting less than its share gets what it wants; the rest goes to the other.
        (10, vec![vec![(1, 1, 2)], vec![(2, 1, 50)]], vec![2, 8]),
        // Demand below the limit: everyone gets theirs, the spare is split evenly.
        (10, vec![vec![(1, 1, 2)], vec![(2, 1, 4)]], vec![4, 6]),
    ];
    for (limit, flows, expected) in rows {
        let flows: Vec<Vec<FlowDemand>> = flows
            .iter()
            .map(|fs| fs.iter().map(|&(t, w, d)| flow(t, w, d)).collect())
            .collect();
        let names = ["r1", "r2", "r3"];
        let members: Vec<MemberLoad<'_>> = flows
            .iter()
            .zip(names)
            .map(|(fs, name)| member(name, fs))
            .collect();
        let shares = divide(limit, &members, NO_STANDBY).shares;
        assert_eq!(targets_of(&shares), expected, "{limit} over {flows:?}");
        assert_eq!(
            grants_of(&shares),
            expected,
            "nothing was committed, so every target is granted at once"
        );
    }
}

#[test]
fn local_weights_make_the_local_queue_split_the_target_as_the_fleet_did() {
    // A (tenant 1) only on r1, B (tenant 2) everywhere: r1's target of 8 is A's 6 and B's 2,
    // so r1's fair queue must weigh A three times B, although both tiers weigh 1: A's whole
    // demand is here, a third of B's.
    let r1 = [flow(1, 1, 50), flow(2, 1, 50)];
    let r2 = [flow(2, 1, 50)];
    let r3 = [flow(2, 1, 50)];
    let shares = divide(
        12,
        &[member("r1", &r1), member("r2", &r2), member("r3", &r3)],
        NO_STANDBY,
    )
    .shares;
    assert_eq!(weight(&shares[0], 1), 1024);
    assert_eq!(weight(&shares[0], 2), 341);
    assert_eq!(weight(&shares[1], 2), 341);
}

#[test]
fn bands_are_strict_and_reservations_come_first() {
    let high = FlowDemand {
        band: 0,
        ..flow(1, 1, 4)
    };
    let low = FlowDemand {
        band: 1,
        ..flow(2, 100, 50)
    };
    let shares = divide(
        10,
        &[member("r1", &[high]), member("r2", &[low])],
        NO_STANDBY,
    )
    .shares;
    assert_eq!(
        targets_of(&shares),
        [4, 6],
        "band 0 takes all it wants, whatever the weights"
    );

    // A low-band tenant with 3 reserved slots keeps them under a flood from band 0.
    let flood = FlowDemand {
        band: 0,
        ..flow(1, 1, 100)
    };
    let reserved = FlowDemand {
        band: 1,
        reserved: 3,
        ..flow(2, 1, 100)
    };
    let shares = divide(
        10,
        &[member("r1", &[flood]), member("r2", &[reserved])],
        NO_STANDBY,
    )
    .shares;
    assert_eq!(targets_of(&shares), [7, 3]);
    assert_eq!(shares[1].overrides[&TenantKey(2)].reserved_slots, 3);

    // A reservation is a floor, not an addition: weight 3 against a reserved weight 1 of 4
    // (its weighted share, 2.5, is under it) ends 6 to 4.
    let heavy = flow(1, 3, 100);
    let floor = FlowDemand {
        reserved: 4,
        ..flow(2, 1, 100)
    };
    let shares = divide(
        10,
        &[member("r1", &[heavy]), member("r2", &[floor])],
        NO_STANDBY,
    )
    .shares;
    assert_eq!(targets_of(&shares), [6, 4]);
}

#[test]
fn a_share_moves_only_once_the_replica_giving_it_up_confirmed() {
    let busy = [flow(1, 1, 50)];
    // Step by step, as the syncs go: r1 held the whole limit (6); r2's tenant arrives.
    // (r1 in flight, applied, handed; r2 the same) → (r1 grant, r2 grant)
    let steps = [
        // The leader hands r1 its new target of 3, but r1 may still admit up to 6 until it
        // confirms, so r2 gets nothing yet.
        ((6, 6, Some(6)), (0, 0, None), (3, 0)),
        // r1 picked up 3 (handed) but its report still says it applies 6.
        ((6, 6, Some(3)), (0, 0, Some(0)), (3, 0)),
        // r1 confirms 3 but still runs 5 requests: one slot is free.
        ((5, 3, Some(3)), (0, 0, Some(0)), (3, 1)),
        // r1 drained to 3: r2 gets its whole target.
        ((3, 3, Some(3)), (1, 1, Some(1)), (3, 3)),
    ];
    for ((r1, r2, expected), step) in steps.into_iter().zip(1..) {
        let members = [
            MemberLoad {
                in_flight: r1.0,
                applied: r1.1,
                handed: r1.2,
                ..member("r1", &busy)
            },
            MemberLoad {
                in_flight: r2.0,
                applied: r2.1,
                handed: r2.2,
                ..member("r2", &busy)
            },
        ];
        let shares = divide(6, &members, NO_STANDBY).shares;
        assert_eq!(targets_of(&shares), [3, 3], "step {step}");
        assert_eq!((shares[0].grant, shares[1].grant), expected, "step {step}");
    }
}

#[test]
fn growers_split_what_is_free_by_what_they_lack() {
    let busy = [flow(1, 1, 50)];
    let other = [flow(2, 1, 50)];
    let third = [flow(3, 1, 50)];
    // r1 is committed to 9 of 12; r2 and r3 lack 4 each and share the 3 free slots.
    let members = [
        MemberLoad {
            in_flight: 9,
            applied: 9,
            handed: Some(9),
            ..member("r1", &busy)
        },
        member("r2", &other),
        member("r3", &third),
    ];
    let shares = divide(12, &members, NO_STANDBY).shares;
    assert_eq!(targets_of(&shares), [4, 4, 4]);
    assert_eq!(grants_of(&shares), [4, 2, 1]);
}

#[test]
fn token_cost_divides_slots_so_that_tokens_follow_the_weights() {
    // Equal weights; A's requests cost ten times B's (worst-case tokens), each on its own
    // replica: A gets a tenth of B's slots, so both get the same tokens.
    let a = [FlowDemand {
        cost: 5_000,
        ..flow(1, 1, 50)
    }];
    let b = [FlowDemand {
        cost: 500,
        ..flow(2, 1, 50)
    }];
    let shares = divide(11, &[member("r1", &a), member("r2", &b)], NO_STANDBY).shares;
    assert_eq!(targets_of(&shares), [1, 10]);
    // Weight 10 against 1 with that cost ratio: even.
    let a = [FlowDemand {
        cost: 5_000,
        ..flow(1, 10, 50)
    }];
    let shares = divide(10, &[member("r1", &a), member("r2", &b)], NO_STANDBY).shares;
    assert_eq!(targets_of(&shares), [5, 5]);
    // The local weights stay the tiers' (the local queue charges tokens itself).
    assert_eq!(shares[0].overrides[&TenantKey(1)].weight, 10 * SHARE_SCALE);
}

#[test]
fn while_the_fleet_reforms_nobody_grows() {
    let busy = [flow(1, 1, 50)];
    // Redis lost its keys: r1 (the new leader) had nothing; r2 still runs the 6 it had.
    let members = [
        member("r1", &busy),
        MemberLoad {
            in_flight: 6,
            applied: 6,
            ..member("r2", &busy)
        },
    ];
    let shares = divide(12, &members, NO_STANDBY).shares;
    assert_eq!(grants_of(&shares), [6, 6], "what dividing would give");
    assert_eq!(
        grants_of(&hold(shares, &members)),
        [0, 6],
        "r1 waits, r2 keeps what it runs"
    );
    // Before r2 has re-registered, the leader sees only itself: it would take everything.
    let alone = [member("r1", &busy)];
    assert_eq!(grants_of(&divide(12, &alone, NO_STANDBY).shares), [12]);
    assert_eq!(
        grants_of(&hold(divide(12, &alone, NO_STANDBY).shares, &alone)),
        [0]
    );
}

#[test]
fn standby_slots_are_kept_only_for_tenants_below_the_level_against_others() {
    // A (tenant 1, weight 2) asks 9 of 30, below its level; B (tenant 2) floods everywhere.
    let a = FlowDemand {
        in_flight: 3,
        queued: 0,
        ..flow(1, 2, 0)
    };
    let r = [a, flow(2, 1, 100)];
    let members = [member("r1", &r), member("r2", &r), member("r3", &r)];
    let shares = divide(30, &members, STANDBY).shares;
    for share in &shares {
        assert!(
            share.overrides[&TenantKey(1)].standby,
            "A is given all it asks"
        );
        assert!(!share.overrides[&TenantKey(2)].standby, "B is at the level");
        // A holds 9 of 30: ρ = 0.3 asks three slots to miss at most 5 %; a quarter of 10 caps it.
        assert_eq!(share.standby, 2, "{share:?}");
    }
    assert_eq!(standbys(120, &members, STANDBY), [2, 2, 2], "ρ = 0.075");
    assert_eq!(standbys(30, &members, NO_STANDBY), [0, 0, 0]);

    // Nobody to hold back (everyone is given all it asks), nobody to hold for (everyone at
    // the level), or one replica alone: none.
    let light = [a];
    let both = [member("r1", &light), member("r2", &light)];
    assert_eq!(standbys(30, &both, STANDBY), [0, 0]);
    let flood = [flow(1, 2, 100), flow(2, 1, 100)];
    let both = [member("r1", &flood), member("r2", &flood)];
    assert_eq!(standbys(30, &both, STANDBY), [0, 0]);
    assert_eq!(standbys(30, &[member("r1", &r)], STANDBY), [0]);

    // What a recent division asked is kept when nobody below the level has demand right now
    // (between two requests), within each replica's cap, and never on a lone replica.
    let held = Standby {
        at_least: 3,
        ..STANDBY
    };
    assert_eq!(
        divide(40, &both, held).standby_asked,
        0,
        "this demand asks none"
    );
    assert_eq!(standbys(40, &both, held), [3, 3]);
    assert_eq!(standbys(8, &both, held), [1, 1]);
    assert_eq!(standbys(40, &[member("r1", &flood)], held), [0]);
    assert_eq!(divide(30, &members, held).standby_asked, 3);
}

#[test]
fn standby_slots_outlive_the_demand_that_asked_for_them_while_its_tenant_is_away() {
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let hold = Duration::from_secs(10);
    let mut kept = StandbyHold::default();
    assert_eq!(kept.at(at(0), |_| false), 0, "nothing asked yet");
    // (time, slots asked for tenant 1, is tenant 1 present) → what the hold keeps at that time
    // (while tenant 1 is present a division counts it, and asks itself)
    let steps = [
        (0, 3, true, 0),
        // Between two of its requests tenant 1 is away and nothing is asked: the 3 stay.
        (5_000, 0, false, 3),
        (9_999, 0, false, 3),
        // Back at the water level (present, asked for by nobody): nothing to keep.
        (9_999, 0, true, 0),
        // Away past the hold: gone.
        (10_000, 0, false, 0),
        // A new ask starts a new hold, whether more or fewer.
        (11_000, 4, true, 0),
        (11_500, 0, false, 4),
        (12_000, 1, false, 1),
        (21_999, 0, false, 1),
        (22_000, 0, false, 0),
    ];
    for (ms, asked, present, expected) in steps {
        kept.note(asked, &[1], at(ms), hold);
        assert_eq!(
            kept.at(at(ms), |tenant| present && tenant == 1),
            expected,
            "at {ms} ms, {asked} asked, present {present}"
        );
    }

    // Two tenants below the level: 1 goes away while 2 stays; the next asks, for 2 alone, do
    // not cut 1's hold short.
    let mut kept = StandbyHold::default();
    kept.note(3, &[1, 2], at(0), hold);
    kept.note(2, &[2], at(1_000), hold);
    assert_eq!(kept.at(at(9_999), |tenant| tenant == 2), 2, "1 is away");
    assert_eq!(
        kept.at(at(10_000), |tenant| tenant == 2),
        0,
        "1's ask lapsed"
    );
    assert_eq!(kept.at(at(10_999), |_| false), 2, "2's runs until 11 s");
    assert_eq!(kept.at(at(11_000), |_| false), 0);
}

fn arbitrary_member() -> impl Strategy<Value = (u32, u32, Option<u32>, Vec<FlowDemand>)> {
    // One tenant has one class everywhere (one policy), so the class follows from its number.
    let flow = (0u64..6, 0u32..8, 0u32..8).prop_map(|(tenant, in_flight, queued)| FlowDemand {
        tenant,
        weight: (tenant as u32 % 3) + 1,
        band: (tenant % 2) as u8,
        reserved: (tenant as u32 % 2) * 2,
        in_flight,
        queued,
        cost: 1 + tenant * 100,
    });
    (
        0u32..10,
        0u32..10,
        proptest::option::of(0u32..10),
        proptest::collection::vec(flow, 0..4),
    )
}

proptest! {
    /// Whatever the loads and however the syncs interleave: targets sum to the limit, and if
    /// the replicas' commitments fit the limit, commitments and new grants together do too,
    /// so no replica can push the sum in flight past it.
    #[test]
    fn grants_never_let_the_sum_in_flight_pass_the_limit(
        limit in 0u32..40,
        loads in proptest::collection::vec(arbitrary_member(), 1..5),
    ) {
        let names: Vec<String> = (0..loads.len()).map(|i| format!("r{i}")).collect();
        let members: Vec<MemberLoad<'_>> = loads
            .iter()
            .zip(&names)
            .map(|((in_flight, applied, handed, flows), name)| MemberLoad {
                member: name,
                in_flight: *in_flight,
                applied: *applied,
                handed: *handed,
                flows,
            })
            .collect();
        let shares = divide(limit, &members, NO_STANDBY).shares;
        prop_assert_eq!(shares.iter().map(|s| u64::from(s.target)).sum::<u64>(), u64::from(limit));
        let committed: u64 = members.iter().map(|m| u64::from(m.commitment())).sum();
        let bound: u64 = members
            .iter()
            .zip(&shares)
            .map(|(m, s)| u64::from(m.commitment().max(s.grant)))
            .sum();
        if committed <= u64::from(limit) {
            prop_assert!(bound <= u64::from(limit), "bound {} over {}", bound, limit);
        } else {
            prop_assert_eq!(bound, committed, "over-committed: nobody may grow");
        }
        for (m, s) in members.iter().zip(&shares) {
            prop_assert!(s.grant <= s.target.max(m.commitment()));
        }
    }
}
