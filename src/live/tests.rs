use super::*;

fn policy(config: &Config) -> Arc<Policy> {
    Arc::new(Policy::from_config(config).expect("a valid test policy"))
}

fn live(config: &Config) -> Arc<Live> {
    let policy = policy(config);
    let metrics = Metrics::new(&*policy);
    Live::new(policy, None, metrics)
}

#[test]
fn what_only_a_restart_can_change() {
    type Edit = fn(&mut Config);
    let table: &[(Edit, &[&str])] = &[
        (|_| {}, &[]),
        (|c| c.enforce = false, &[]),
        (|c| c.control.ceiling = 40, &[]),
        (|c| c.tiers.get_mut("free").unwrap().weight = 3, &[]),
        (|c| c.scheduler.initial_limit = 7, &[]),
        (|c| c.scheduler.max_queued_body_bytes += 1, &[]),
        (
            |c| c.listen.grpc_addr = "127.0.0.1:1".to_owned(),
            &["listen.grpc_addr"],
        ),
        (
            |c| c.listen.admin_addr = "127.0.0.1:1".to_owned(),
            &["listen.admin_addr"],
        ),
        (
            |c| c.store.redis_url = Some("redis://127.0.0.1:1".to_owned()),
            &["store"],
        ),
        (|c| c.store.timeout_ms += 1, &["store"]),
        (|c| c.fleet.name = "other".to_owned(), &["fleet.name"]),
        (
            |c| c.fleet.member_id = "me".to_owned(),
            &["fleet.member_id"],
        ),
        (|c| c.fleet.sync_ms += 1, &["fleet.sync_ms"]),
        (|c| c.fleet.member_ttl_ms += 1, &[]),
        (|c| c.control.window_ms += 1000, &["control.window_ms"]),
        (|c| c.shutdown.drain_deadline_ms += 1, &[]),
        (|c| c.tokens.max_body_bytes += 1, &["tokens.max_body_bytes"]),
        (
            |c| c.tokens.large_body_threads = 3,
            &["tokens.large_body_threads"],
        ),
        (|c| c.tokens.large_body_max_wait_ms += 1, &[]),
        (
            |c| c.admin.token_file = Some("/t".to_owned()),
            &["admin.token_file"],
        ),
        (|c| c.reload.watch_ms = 0, &["reload.watch_ms"]),
        (
            |c| c.scheduler.headroom.enabled = false,
            &["scheduler.headroom"],
        ),
        (
            |c| {
                c.listen.grpc_addr = "127.0.0.1:1".to_owned();
                c.fleet.name = "other".to_owned();
            },
            &["listen.grpc_addr", "fleet.name"],
        ),
    ];
    let running = Config::default();
    for (edit, want) in table {
        let mut next = running.clone();
        edit(&mut next);
        assert_eq!(restart_only_changes(&running, &next), *want, "{next:?}");
    }
}

#[test]
fn settings_replace_the_files_values_or_name_what_is_wrong() {
    let file = policy(&Config::default());
    let engine = EngineThresholds {
        kv_cache_threshold: 0.5,
        queue_depth_threshold: 3,
    };
    let switch = ControlSwitch {
        enabled: false,
        floor: 2,
        ceiling: 9,
    };
    let applied = Settings {
        engine: Some(engine),
        control: Some(switch),
    }
    .apply(&file)
    .unwrap();
    assert_eq!(Settings::engine_in(&applied), engine);
    assert_eq!(Settings::control_in(&applied.control), switch);
    // Run-time settings are not the policy replicas must agree on.
    assert_eq!(applied.hash, file.hash);
    assert_eq!(
        Settings::default().apply(&file).unwrap().control,
        file.control
    );

    let table: &[(Settings, &str)] = &[
        (
            Settings {
                engine: Some(EngineThresholds {
                    kv_cache_threshold: 1.5,
                    ..engine
                }),
                control: None,
            },
            "control.engine.kv_cache_threshold",
        ),
        (
            Settings {
                engine: Some(EngineThresholds {
                    queue_depth_threshold: 0,
                    ..engine
                }),
                control: None,
            },
            "control.engine.queue_depth_threshold",
        ),
        (
            Settings {
                engine: None,
                control: Some(ControlSwitch { floor: 0, ..switch }),
            },
            "control.floor",
        ),
        (
            Settings {
                engine: None,
                control: Some(ControlSwitch {
                    floor: 10,
                    ceiling: 9,
                    ..switch
                }),
            },
            "control.ceiling",
        ),
    ];
    for (settings, field) in table {
        let problems = settings.apply(&file).unwrap_err();
        assert!(
            problems.iter().any(|p| p.starts_with(field)),
            "{settings:?}: {problems:?}"
        );
    }
}

#[test]
fn settings_stored_by_another_replica_decode_or_are_named() {
    let stored = HashMap::from([
        (
            "engine".to_owned(),
            r#"{"kv_cache_threshold":0.7,"queue_depth_threshold":4}"#.to_owned(),
        ),
        ("control".to_owned(), r#"{"enabled":true}"#.to_owned()),
        ("future".to_owned(), "anything".to_owned()),
    ]);
    let (settings, unreadable) = Settings::decode(&stored);
    assert_eq!(
        settings.engine,
        Some(EngineThresholds {
            kv_cache_threshold: 0.7,
            queue_depth_threshold: 4
        })
    );
    assert_eq!(settings.control, None);
    assert_eq!(unreadable.len(), 1);
    assert!(unreadable[0].starts_with("control:"), "{unreadable:?}");
}

#[tokio::test]
async fn a_reload_applies_whole_or_not_at_all() {
    let running = Config::default();
    let live = live(&running);
    let before = live.current();
    let mut changes = live.subscribe();

    // The same configuration: nothing to do.
    let same = running.clone();
    assert_eq!(
        live.reload(move || Ok(same), "test").await,
        Ok(Reloaded::Unchanged)
    );

    // Invalid: every problem, and the policy in force stays.
    let mut invalid = running.clone();
    invalid.tiers.get_mut("free").unwrap().weight = 0;
    invalid.control.floor = 0;
    let problems = live.reload(move || Ok(invalid), "test").await.unwrap_err();
    assert!(
        problems.iter().any(|p| p.contains("weight")),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.starts_with("control.floor")),
        "{problems:?}"
    );
    // A file that does not load at all.
    let problems = live
        .reload(
            || Err(ConfigError("tiers.free.weight: invalid type".to_owned())),
            "test",
        )
        .await
        .unwrap_err();
    assert_eq!(problems, ["tiers.free.weight: invalid type"]);
    // A setting only a restart can change is named, beside any other problem.
    let mut restart = running.clone();
    restart.listen.grpc_addr = "127.0.0.1:1".to_owned();
    restart.scheduler.initial_limit = 0;
    let problems = live.reload(move || Ok(restart), "test").await.unwrap_err();
    assert!(
        problems[0].starts_with("listen.grpc_addr: cannot change while running"),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("scheduler.initial_limit")),
        "{problems:?}"
    );
    assert!(!changes.has_changed().unwrap());
    assert!(Arc::ptr_eq(&live.current(), &before));

    // Valid: applied, and announced.
    let mut next = running.clone();
    next.tiers.get_mut("free").unwrap().weight = 5;
    next.enforce = false;
    assert_eq!(
        live.reload(move || Ok(next), "test").await,
        Ok(Reloaded::Applied {
            changed: vec!["enforce".to_owned(), "tiers".to_owned()]
        })
    );
    assert!(changes.has_changed().unwrap());
    let now = changes.borrow_and_update().clone();
    let free = now.tier_named("free").unwrap();
    assert_eq!(now.tiers[free].weight, 5);
    assert!(!now.tiers[free].enforce);
    assert_ne!(now.hash, before.hash);
    // The request path's rules follow, with the metrics of the new tiers.
    assert_eq!(live.subscribe_rules().borrow().policy.hash, now.hash);
}

#[tokio::test]
async fn settings_survive_a_reload_and_fall_back_to_the_file_when_deleted() {
    let running = Config::default();
    let live = live(&running);
    let switch = ControlSwitch {
        enabled: true,
        floor: 3,
        ceiling: 30,
    };
    live.set(Change::Control(Some(switch))).await.unwrap();
    assert_eq!(Settings::control_in(&live.current().control), switch);

    // Invalid: refused whole, nothing changes.
    let wrong = Change::Control(Some(ControlSwitch {
        floor: 31,
        ..switch
    }));
    assert!(matches!(
        live.set(wrong).await,
        Err(SettingError::Invalid(_))
    ));
    assert_eq!(Settings::control_in(&live.current().control), switch);

    // A reload keeps the setting in place of the file's new values.
    let mut next = running.clone();
    next.control.ceiling = 50;
    next.control.target_p99_ttft_ms += 1;
    live.reload(move || Ok(next), "test").await.unwrap();
    let policy = live.current();
    assert_eq!(Settings::control_in(&policy.control), switch);
    assert_eq!(
        policy.control.target_p99_ttft_ms,
        running.control.target_p99_ttft_ms + 1
    );

    // Deleted: the file's values apply again.
    live.set(Change::Control(None)).await.unwrap();
    assert_eq!(live.current().control.ceiling, 50);
    assert_eq!(live.settings(), Settings::default());
}
