use super::*;

#[test]
fn fallback_budgets_follow_the_configured_rule() {
    use FleetFallback::{LastShare, Split};
    // (rule, last share, limit, replicas last seen) → the local budget
    let rows = [
        (LastShare, Some(5), 12, 3, 5),
        (LastShare, None, 12, 3, 4),
        (Split, Some(5), 12, 3, 4),
        (Split, None, 12, 0, 12),
        (LastShare, Some(0), 12, 3, 4),
        (Split, None, 2, 4, 1),
    ];
    for (rule, last, limit, replicas, expected) in rows {
        assert_eq!(
            fallback_limit(rule, last, limit, replicas),
            expected,
            "{rule:?} {last:?} {limit} {replicas}"
        );
    }
}

#[test]
fn overrides_survive_their_encoding() {
    let overrides: HashMap<TenantKey, Share> = [
        (
            TenantKey(7),
            Share {
                weight: 600,
                reserved_slots: 2,
                standby: true,
            },
        ),
        (
            TenantKey(u64::MAX),
            Share {
                weight: 1,
                reserved_slots: 0,
                standby: false,
            },
        ),
    ]
    .into();
    assert_eq!(
        decode_overrides(&encode_overrides(&overrides, 3)),
        (overrides, 3)
    );
    assert_eq!(decode_overrides(""), (HashMap::new(), 0));
    assert_eq!(
        decode_overrides("not json"),
        (HashMap::new(), 0),
        "a foreign value is no overrides"
    );
}

#[test]
fn a_report_survives_its_encoding() {
    let report = Report {
        in_flight: 3,
        applied: 4,
        peak_in_flight: 4,
        queued: 9,
        held: 5,
        stream_ended: true,
        ttft: vec![(10, 3), (200, 1)],
        flows: vec![FlowDemand {
            tenant: TenantKey::of("alice").0,
            weight: 2,
            band: 1,
            reserved: 0,
            in_flight: 3,
            queued: 9,
            cost: 640,
        }],
    };
    let text = serde_json::to_string(&report).unwrap();
    assert_eq!(serde_json::from_str::<Report>(&text).unwrap(), report);
}
